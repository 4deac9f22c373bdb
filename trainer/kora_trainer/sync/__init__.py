"""Weight sync, the trainer's side: push the policy from the trainer to the rollout engines.

Production's path stands here, at the top: `sender.py` (`WeightSender`, one strategy object per sync mode, and the
`Sender` protocol every sender keeps), `transport.py` (the weight-update group, or in memory over IPC), `sources.py`
(what a push is made of), `delta.py` (the collective delta-skip), `slot_sender.py` (multi-LoRA) — HTTP/IPC into
SGLang's routes, which kora's reference engine also answers. `fast/` holds the path that ONLY kora's reference engine
answers (its `/kora/fast_sync/*` routes and the colocated shared-memory handshake), fenced: it wraps production's
sender and is never imported by it.
"""
