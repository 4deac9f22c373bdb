"""kora's reference rollout engine (`rollout.engine: hf`): an HF-transformers server with SGLang's routes and
payloads, standing in for SGLang where SGLang cannot run. See README.md beside this file."""
