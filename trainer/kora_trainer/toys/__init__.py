"""The tiny models the tests, the benchmarks and the demo make on disk (`kora make-toy`): lm.py (a Qwen3 causal
LM and its parquet data), vl.py (a Qwen3.5 vision-language model, dense or MoE, with image prompts),
diffusion.py (an SD3 transformer with prompt embeddings) and diffusion_policy.py (that toy's velocity function
as Flow-GRPO and the diffusion engine both call it)."""
