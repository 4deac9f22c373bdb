"""The fast path of weight sync, fenced: ONLY kora's reference engine answers it (engine/kora_engine, its
`/kora/fast_sync/*` routes and the colocated shared-memory handshake of wire/colocated_words.py). No SGLang build
takes it: against SGLang, and wherever `path.fast_path_off` says so, the job stays on production's path
(sync/sender.py: HTTP/IPC into the engine's own routes), which this package wraps and never replaces.

- `path.py`: `with_fast_path(sender, cfg)`, the one entry (TrainWorker.connect): the HTTP sender, or wrapped.
- `base.py`: `FastSender`, the steps both fast senders share: the HTTP path's first push, one plan, fast pushes.
- `distributed.py`: `FastWeightSender`, over the weight-update group (`/kora/fast_sync/plan|push`).
- `colocated.py`: `ColocatedFastSender`, in the memory of the engines beside the trainer, mapped once; its modes
  are `colocated_modes.py`'s strategy objects (Merge / Adapter / EngineMerge), its handshake `handshake.py`, its
  ring of adapter slots and its delta decision `ring.py`.
- `plan.py`, `adapter_pack.py`, `colocated_merge.py`: the plans and kernels' callers (fold graphs, one gather).
- `policy.py`: what the plan reads from the policy (`PolicyPlan`; a backend's sender may give its own: megatron).

Production's modules (sender, transport, sources, delta, slot_sender) never import this package (import-linter).
"""
