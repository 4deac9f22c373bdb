"""kora's reference engines: server processes the trainer launches (`python -m kora_engine.lm`,
`python -m kora_engine.diffusion.server`) and speaks to over HTTP only. They import `kora_trainer.wire` and
`kora_trainer.config` (and the few shared helpers the import-linter contract in pyproject.toml lists); the
trainer never imports this package.

  lm/         the reference LM engine: SGLang's routes on an HF-transformers model (its own README.md)
  diffusion/  the reference diffusion engine: sglang-diffusion's rollout and weight-update routes on the toy
  faults.py   the test-only fault knob both serve
"""
