"""Weight sync from a tensor-parallel (TP = 2) megatron policy, on CPU: gloo groups, one thread per rank.

The policy stands in for a TP = 2 megatron GPTModel: modules under megatron's names holding each rank's shards
(cut by `convert.to_megatron_shard` / `adapter_from_hf` from one full HF model and HF-PEFT adapter), the LoRA
wrappers being the backend's own classes (built without megatron-core, which this machine lacks). Weights and
factors are small integers, so every fold is exact in fp32 and what the engine gets must equal the full HF
model's fold bit for bit — whatever the sharding, the row maps and the bucket boundaries.

- the fast path: `merge_entries` / `adapter_specs` per rank -> `plan.MergePlan` / `PipelinedSender` (rank 0
  with the weight-update group, rank 1 only gathering) -> `PipelinedReceiver` / `AdapterRing` on an engine rank;
- the HTTP path: `MegatronWeightSender` on both ranks, rank 1 finding itself a follower; rank 0's buckets are
  recorded and reassembled; the delta-skip decision is the TP group's (a change on rank 1 alone pushes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from kora_trainer.backends.megatron.convert import (
    PEFT_PREFIX,
    Layout,
    adapter_from_hf,
    adapter_modules,
    column_parallel,
    param_maps,
    to_megatron_shard,
)

TP = 2
LAYOUT = Layout(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2)
HIDDEN, INTER, VOCAB, R, ALPHA = 8, 8, 32, 2, 4.0
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1"]  # linear_fc2 stays plain: a column-sharded copy
CAP = 600  # bytes: several buckets; the 1 KiB embedding / lm_head are split over buckets by rows


def _hf_shape(name: str) -> tuple[int, ...]:
    hd, kv = LAYOUT.num_heads * LAYOUT.head_dim, LAYOUT.num_kv_heads * LAYOUT.head_dim
    leaf = name.rsplit(".", 2)[-2]
    shapes = {"embed_tokens": (VOCAB, HIDDEN), "lm_head": (VOCAB, HIDDEN), "q_proj": (hd, HIDDEN),
              "k_proj": (kv, HIDDEN), "v_proj": (kv, HIDDEN), "o_proj": (HIDDEN, hd), "gate_proj": (INTER, HIDDEN),
              "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER), "q_norm": (LAYOUT.head_dim,),
              "k_norm": (LAYOUT.head_dim,)}
    return shapes.get(leaf, (HIDDEN,))  # the other norms


def _ints(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=g).float()


def full_model(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(HF state, HF-PEFT adapter): integer-valued fp32; q/k/v (gate/up) share one A, as a fused LoRA does."""
    g = torch.Generator().manual_seed(seed)
    state = {n: _ints(g, _hf_shape(n)) for pm in param_maps(LAYOUT) for n in pm.hf}
    adapter = {}
    for hf_modules, _ in adapter_modules(LAYOUT, TARGETS).values():
        a = _ints(g, (R, _hf_shape(f"{hf_modules[0]}.weight")[1]))
        for m in hf_modules:
            adapter[f"{PEFT_PREFIX}{m}.lora_A.weight"] = a.clone()
            adapter[f"{PEFT_PREFIX}{m}.lora_B.weight"] = _ints(g, (_hf_shape(f"{m}.weight")[0], R))
    return state, adapter


def merged(state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(state)
    for hf_modules, _ in adapter_modules(LAYOUT, TARGETS).values():
        for m in hf_modules:
            b, a = adapter[f"{PEFT_PREFIX}{m}.lora_B.weight"], adapter[f"{PEFT_PREFIX}{m}.lora_A.weight"]
            out[f"{m}.weight"] = state[f"{m}.weight"] + (ALPHA / R) * (b @ a)
    return out


def _put(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        child = root._modules.get(p)
        if child is None:
            child = nn.Module()
            root.add_module(p, child)
        root = child
    root.add_module(leaf, module)


def shard_model(state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], rank: int) -> nn.Module:
    """TP rank `rank`'s policy: megatron parameter names, its shards, the real LoRA wrapper classes."""
    from kora_trainer.backends.megatron import lora

    root = nn.Module()
    wrapped = adapter_modules(LAYOUT, TARGETS)
    for pm in param_maps(LAYOUT):
        path = pm.megatron.rsplit(".", 1)[0]
        holder = nn.Module()
        holder.weight = nn.Parameter(to_megatron_shard(pm.kind, [state[n] for n in pm.hf], LAYOUT, rank, TP).clone(),
                                     requires_grad=False)
        module: nn.Module = holder
        if path in wrapped:
            hf_modules, kind = wrapped[path]
            a, b = adapter_from_hf(hf_modules, kind, adapter, LAYOUT, rank, TP)
            cls = lora.LoRAColumnParallelLinear if column_parallel(kind) else lora.LoRARowParallelLinear
            m = cls.__new__(cls)  # the wrapper without its megatron-core set-up
            nn.Module.__init__(m)
            m.base_layer = holder
            m.lora_A = nn.Linear(a.shape[1], R, bias=False)
            m.lora_B = nn.Linear(R, b.shape[0], bias=False)
            with torch.no_grad():
                m.lora_A.weight.copy_(a)
                m.lora_B.weight.copy_(b)
            m.rank, m.alpha, m.scaling, m.enabled, m.tp_rank, m.tp_size = R, ALPHA, ALPHA / R, True, rank, TP
            m.dropout = nn.Identity()
            module = m
        _put(root, path, module)
    return root


def set_adapter(model: nn.Module, adapter: dict[str, torch.Tensor], rank: int) -> None:
    from kora_trainer.backends.megatron.lora import lora_modules

    mapping = adapter_modules(LAYOUT, TARGETS)
    with torch.no_grad():
        for name, m in lora_modules(model).items():
            a, b = adapter_from_hf(*mapping[name], adapter, LAYOUT, rank, TP)
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(b)


def groups(n: int) -> list[Any]:
    """n ranks of a gloo WeightUpdateGroup, each made on its own thread."""
    from kora_trainer.wire.group import init_weight_update_group
    from kora_trainer.wire.ports import free_port

    port, out = free_port(), {}
    threads = [threading.Thread(target=lambda r=r: out.setdefault(r, init_weight_update_group(
        "127.0.0.1", port, r, n, "t", timeout_s=30))) for r in range(1, n)]
    for t in threads:
        t.start()
    out[0] = init_weight_update_group("127.0.0.1", port, 0, n, "t", timeout_s=30)
    for t in threads:
        t.join()
    return [out[r] for r in range(n)]


LOCAL = threading.local()  # the TP group of the thread playing a TP rank (the megatron hooks below read it)


def run(*fns: Callable[[], Any], tps: list[Any] | None = None) -> list[Any]:
    """Run fns concurrently (fn i as TP rank i when `tps`); their results, the first error raised."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        LOCAL.tp = tps[i] if tps is not None and i < len(tps) else None
        try:
            results[i] = fns[i]()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung (unmatched collectives)"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def megatron_tp(monkeypatch):
    """megatron's TP hooks (rank / size, the shard all-gather, the TP group) answered by the thread's gloo group;
    one pipeline stage."""
    from kora_trainer.backends.megatron import export, model, parallel
    from kora_trainer.backends.megatron import sync as msync

    def rank() -> int:
        tp = getattr(LOCAL, "tp", None)
        return 0 if tp is None else tp.rank

    def gather_tp(t: torch.Tensor) -> list[torch.Tensor]:
        outs = [torch.empty_like(t) for _ in range(TP)]
        LOCAL.tp.pg.allgather([outs], [t.contiguous()]).wait()
        return outs

    monkeypatch.setattr(parallel, "tp_rank_size", lambda: (rank(), TP))
    monkeypatch.setattr(model, "gather_tp", gather_tp)
    monkeypatch.setattr(export, "gather_tp", gather_tp)
    monkeypatch.setattr(msync, "tp_group", lambda: LOCAL.tp)
    monkeypatch.setattr(msync, "model_parallel_group", lambda: LOCAL.tp)  # one pipeline stage: the TP group
    monkeypatch.setattr(msync, "pp_rank_size", lambda: (0, 1))
    monkeypatch.setattr(parallel, "pp_rank_size", lambda: (0, 1))
    monkeypatch.setattr(parallel, "ep_rank_size", lambda: (0, 1))


def _push_merge(plans: list[Any], tp: list[Any], wu: list[Any], want: dict[str, torch.Tensor],
                then: Callable[[], Any] | None = None) -> dict[str, torch.Tensor]:
    """Push through the fast path (rank 0 + rank 1 -> engine) and return what the engine holds; with `then`,
    push, check `want`, run `then` (e.g. a training step), push again with the same senders and receiver."""
    from kora_trainer.sync.fast import plan as fast
    from kora_trainer.wire import fast_receive

    params = {n: torch.zeros_like(t) for n, t in want.items()}
    senders = [fast.PipelinedSender(plans[0], wu[0], tp=tp[0]), fast.PipelinedSender(plans[1], None, tp=tp[1])]
    receiver = fast_receive.PipelinedReceiver(plans[0].metadata, params, wu[1])

    def push() -> None:
        run(lambda: (senders[0].push(), fast_receive.ack(wu[0])), senders[1].push,
            lambda: (receiver.receive(), fast_receive.ack(wu[1])))

    push()
    if then is not None:
        assert all(torch.equal(params[n], t) for n, t in want.items())
        then()
        push()
    return params


def test_fast_merge_sync_gathers_tp_shards_into_the_buckets(megatron_tp):
    from kora_trainer.backends.megatron.sync import merge_entries
    from kora_trainer.sync.fast import plan as fast

    state, adapter = full_model()
    models = [shard_model(state, adapter, r) for r in range(TP)]
    tp, wu = groups(TP), groups(2)  # TP group {rank 0, rank 1}; weight-update group {rank 0, engine}
    for merge, want in ((True, merged(state, adapter)), (False, state)):
        plans = [fast.MergePlan(merge_entries(m, LAYOUT, merge), CAP) for m in models]
        assert plans[0].metadata == plans[1].metadata and plans[0].tp == TP  # the same buckets on every rank
        assert len(plans[0].buckets) > 3 and all(b.nbytes <= CAP for b in plans[0].buckets)
        split = [n for n in ("model.embed_tokens.weight", "lm_head.weight")
                 if sum(n in m["names"] for m in plans[0].metadata) > 1]
        assert split  # a row-sharded tensor larger than the cap went over several buckets
        bad = [n for n, t in _push_merge(plans, tp, wu, want).items() if not torch.equal(t, want[n])]
        assert not bad, bad
    # the plan reads the live parameters: a changed adapter lands on the next push of the same senders
    _, adapter2 = full_model(seed=1)
    plans = [fast.MergePlan(merge_entries(m, LAYOUT), CAP) for m in models]
    want = merged(state, adapter2)
    got = _push_merge(plans, tp, wu, merged(state, adapter), then=lambda: [set_adapter(m, adapter2, r)
                                                                            for r, m in enumerate(models)])
    assert all(torch.equal(got[n], t) for n, t in want.items())
    with pytest.raises(ValueError, match="tensor parallel size"):
        fast.PipelinedSender(plans[0], wu[0])  # a TP plan without its TP group


def test_fast_adapter_pack_gathers_tp_shards(megatron_tp):
    from kora_trainer.backends.megatron.lora import adapter_parameters
    from kora_trainer.backends.megatron.sync import adapter_specs
    from kora_trainer.sync.fast import adapter_pack as fast_adapter
    from kora_trainer.wire import fast_receive

    state, adapter = full_model()
    models = [shard_model(state, adapter, r) for r in range(TP)]
    tp, wu = groups(TP), groups(2)
    packs = [fast_adapter.AdapterPack(adapter_parameters(m), adapter_specs(m, LAYOUT), 100, tp=g)
             for m, g in zip(models, tp, strict=True)]
    assert len(packs[0].buckets) > 1
    ring = fast_receive.AdapterRing(packs[0].metadata, torch.device("cpu"), {"*": ALPHA / R})
    got = run(lambda: packs[0].push(wu[0]), lambda: packs[1].push(None), lambda: ring.receive(wu[1]))[2]
    assert ring.rank == R
    want = {}
    for hf_modules, _ in adapter_modules(LAYOUT, TARGETS).values():
        for m in hf_modules:
            want[m] = (adapter[f"{PEFT_PREFIX}{m}.lora_A.weight"], adapter[f"{PEFT_PREFIX}{m}.lora_B.weight"])
    assert set(got) == set(want)
    for m, (a, b) in want.items():
        assert torch.equal(got[m][0], a) and torch.equal(got[m][1], b), m


class _Client:
    """What the sender's route calls see; records which route each bucket took."""

    def __init__(self) -> None:
        self.route = ""

    def update_weights_from_distributed(self, meta: Any, **kw: Any) -> dict[str, Any]:
        self.route = "lora_merge" if kw.get("weight_update_mode") == "lora_merge" else "weights"
        return {}

    def load_lora_adapter_from_distributed(self, name: str, config: Any, meta: Any, **kw: Any) -> dict[str, Any]:
        self.route = "adapter"
        return {}


def _recorder() -> Any:
    from kora_trainer.sync.transport import DistributedTransport
    from kora_trainer.wire.protocol import pack

    class Recorder(DistributedTransport):
        """Rank 0's transport with the engines replaced by a record of (route, metadata, bucket bytes)."""

        def __init__(self) -> None:
            self.clients, self.timeout_s, self.sent = [], 1.0, []

        def send(self, bucket, tensors, call):  # type: ignore[no-untyped-def]
            client = _Client()
            call(client, bucket.metadata())
            self.sent.append((client.route, bucket.metadata(), pack(bucket, tensors)))
            return []

        def close(self) -> None:
            pass

    return Recorder()


def _received(sent: list[Any], route: str) -> dict[str, torch.Tensor]:
    from kora_trainer.wire.protocol import Assembler

    asm, out = Assembler(), {}
    for r, meta, flat in sent:
        if r == route:
            out.update((n, t.clone()) for n, t in asm.feed(meta, flat))
    assert not asm.incomplete
    return out


def _cfg(tmp_path, mode: str) -> Any:
    from kora_trainer.config import load_config

    overrides = [f"model.path={tmp_path}", "data.path=unused.parquet", f"lora.rank={R}", f"lora.alpha={ALPHA}",
                 f"lora.syncMode={mode}", f"sync.bufferSize={CAP}"]
    cfg, _ = load_config(None, overrides, base={"lora": {"rank": R, "targetModules": TARGETS},
                                                "rollout": {"engine": "hf"}})  # kora's reference engine
    return cfg


@pytest.mark.parametrize("mode", ["Merge", "Adapter", "EngineMerge"])
def test_http_sender_at_tp2_follows_rank0(megatron_tp, tmp_path, mode):
    from kora_trainer.backends.megatron.sync import MegatronWeightSender

    state, adapter = full_model()
    models = [shard_model(state, adapter, r) for r in range(TP)]
    tp = groups(TP)
    cfg = _cfg(tmp_path, mode)
    rec = _recorder()
    senders = run(lambda: MegatronWeightSender(models[0], LAYOUT, cfg, rec),
                  lambda: MegatronWeightSender(models[1], LAYOUT, cfg, None), tps=tp)
    assert senders[1].transport.kind == "follower" and senders[0].transport is rec
    assert senders[1].trainer_group is tp[1]  # the skip decision spans the TP group

    def sync(version: int) -> list[Any]:
        return run(lambda: senders[0].sync(version), lambda: senders[1].sync(version), tps=tp)

    reports = sync(1)
    first_bytes = reports[0].bytes
    assert all(r.pushed for r in reports) and reports[1].transport == "follower"
    assert (reports[0].checksum, reports[0].bytes, reports[0].buckets) == \
        (reports[1].checksum, reports[1].bytes, reports[1].buckets)  # the follower made the same buckets
    assert reports[0].buckets > 2
    if mode == "Merge":
        got, want = _received(rec.sent, "weights"), merged(state, adapter)
    elif mode == "Adapter":
        got, want = _received(rec.sent, "weights"), state
        assert reports[0].what == "base+adapter"
        pairs = _received(rec.sent, "adapter")
        assert set(pairs) == set(adapter) and all(torch.equal(pairs[n], t) for n, t in adapter.items())
    else:
        got, want = _received(rec.sent, "lora_merge"), adapter
    assert set(got) == set(want)
    bad = [n for n, t in want.items() if not torch.equal(got[n], t)]
    assert not bad, bad
    # unchanged: skipped on both ranks; a change on rank 1's shard alone: both push (the MAX over the TP group)
    assert not any(r.pushed for r in sync(2))
    moved = dict(adapter)
    q_b = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"
    moved[q_b] = adapter[q_b].clone()
    moved[q_b][LAYOUT.num_heads * LAYOUT.head_dim // TP:] += 1  # q rows of the KV group TP rank 1 holds
    for r, m in enumerate(models):
        set_adapter(m, moved, r)
    assert senders[0].tracker.local_max_delta(senders[0].adapter_named()) == 0.0
    rec.sent.clear()
    reports = sync(3)
    assert all(r.pushed for r in reports) and reports[0].max_delta == 1.0
    if mode == "Merge":  # only the weights a fold changes: the frozen rest went with the first push
        got, want = _received(rec.sent, "weights"), merged(state, moved)
        changed = {n for n, t in want.items() if not torch.equal(t, state[n])}
        assert reports[0].what == "adapted" and changed <= set(got) < set(want), sorted(set(want) - set(got))[:3]
        assert "model.embed_tokens.weight" not in got and all(torch.equal(t, want[n]) for n, t in got.items())
        assert reports[0].bytes < first_bytes and reports[1].bytes == reports[0].bytes  # the follower's plan too
    elif mode == "Adapter":
        assert reports[0].what == "adapter"  # the base went once
        got = _received(rec.sent, "adapter")
        assert all(torch.equal(got[n], t) for n, t in moved.items())
