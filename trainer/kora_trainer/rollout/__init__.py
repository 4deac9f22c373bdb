"""Rollout engines and the one client the trainer uses for both of them.

- `client.EngineClient`: SGLang's HTTP API (sglang 0.5.23), for a real SGLang server and for
  kora's reference engine alike.
- `hf_server`: the reference engine (`rollout.engine: hf`), an HF-transformers server that
  implements the same routes and payloads; it stands in for SGLang where SGLang cannot run.
- `sglang_launcher`: the command lines that start either engine from a TrainerConfig.

Importing this package imports nothing heavy; import the submodules you need.
"""
