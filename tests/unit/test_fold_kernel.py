"""The fold entry point: fp32 accumulate, one rounding; the Triton path is checked on GPU."""

from __future__ import annotations

import pytest
import torch

from kora_trainer.kernels.fold import fold, fold_reference


def _inputs(device: str, m=300, n=257, r=8, wdtype=torch.bfloat16, adtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(m, n, generator=g).to(device=device, dtype=wdtype)
    a = (torch.randn(r, n, generator=g) * 0.1).to(device=device, dtype=adtype)
    b = (torch.randn(m, r, generator=g) * 0.1).to(device=device, dtype=adtype)
    return w, a, b


def test_cpu_fold_rounds_once():
    w, a, b = _inputs("cpu")
    got = fold(w, a, b, 2.0)
    exact = (w.double() + 2.0 * (b.double() @ a.double())).to(torch.bfloat16)
    # one rounding of an fp32 sum: at most one bf16 ulp from the correctly rounded fp64 result
    ulp = (exact.float().abs() * 2**-7).clamp_min(2**-126)
    assert ((got.float() - exact.float()).abs() <= ulp).all()
    out = torch.empty_like(w)
    assert fold(w, a, b, 2.0, out=out) is out and torch.equal(out, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("r", [8, 16, 32, 128])
@pytest.mark.parametrize("adtype", [torch.float32, torch.bfloat16])
def test_triton_fold_matches_reference(r, adtype):
    w, a, b = _inputs("cuda", m=1000, n=777, r=r, adtype=adtype)
    got = fold(w, a, b, 0.5)
    ref = fold_reference(w, a, b, 0.5)
    # both accumulate in fp32 but in different orders (and tf32 splits), so allow one bf16 ulp of the
    # larger term: near-cancelling sums can round to different neighbours
    delta = (b.float() @ a.float()).abs() * 0.5
    ulp = (torch.maximum(w.float().abs(), delta) * 2**-7).clamp_min(2**-126)
    assert ((got.float() - ref.float()).abs() <= ulp).all()
    assert (got == ref).float().mean() > 0.99


# ---- grouped folds, row maps, and the fast sync path built on them (sync/fast/plan.py) --------------------

def _item(m, n, r, lora=True, row_map=False, device="cpu", seed=0, out=None):
    from kora_trainer.kernels.fold import FoldItem

    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(m, n, generator=g).to(device=device, dtype=torch.bfloat16)
    a = (torch.randn(r, n, generator=g) * 0.1).to(device=device, dtype=torch.bfloat16) if lora else None
    b = (torch.randn(m, r, generator=g) * 0.1).to(device=device, dtype=torch.bfloat16) if lora else None
    rmap = torch.randperm(m, generator=g).to(device=device, dtype=torch.int32) if row_map else None
    return FoldItem(w, torch.empty_like(w) if out is None else out, a, b, 0.5, rmap)


def _expected(it):
    src = fold_reference(it.w, it.a, it.b, it.scale) if it.a is not None else it.w
    if it.row_map is None:
        return src
    out = torch.empty_like(src)
    out[it.row_map.long()] = src
    return out


def test_row_mapped_and_grouped_folds_on_cpu():
    from kora_trainer.kernels.fold import GroupedFold

    it = _item(40, 24, 4, row_map=True)
    assert torch.equal(fold(it.w, it.a, it.b, 0.5, row_map=it.row_map), _expected(it))
    items = [_item(40, 24, 4, row_map=True, seed=1), _item(16, 8, 4, seed=2), _item(8, 24, 0, lora=False, seed=3),
             _item(8, 16, 0, lora=False, row_map=True, seed=4)]
    GroupedFold(items)()
    for it in items:
        assert torch.equal(it.out, _expected(it))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fma", [False, True])
@pytest.mark.parametrize("launch", ["graph", "grouped"])
def test_grouped_fold_on_gpu_matches_reference(fma, launch):
    from kora_trainer.kernels.fold import GroupedFold

    flat = torch.empty(1 << 22, dtype=torch.bfloat16, device="cuda")
    shapes = [(640, 256, 32, True, True), (256, 512, 32, True, False), (96, 128, 32, True, False),
              (64, 256, 0, False, False), (128, 64, 0, False, True)]
    items, off = [], 0
    for i, (m, n, r, lora, rmap) in enumerate(shapes):
        out = flat[off:off + m * n].view(m, n)
        off += m * n
        items.append(_item(m, n, r, lora, rmap, "cuda", seed=i, out=out))
    gf = GroupedFold(items, fma=fma, launch=launch, streams=2)
    assert not gf.fallback
    assert len(gf.launches) == 2 if launch == "grouped" else len(gf.singles) == 5  # grouped: folds, copies
    for _ in range(2):  # the graph is captured on the first call and replayed on the second
        for it in items:
            it.out.fill_(float("nan"))
        gf()
    for it in items:
        want = _expected(it)
        if it.a is None:
            assert torch.equal(it.out, want)
            continue
        delta = (it.b.float() @ it.a.float()).abs() * it.scale
        ulp = (torch.maximum(it.w.float().abs(), delta) * 2**-7).clamp_min(2**-126)
        perm = it.row_map.long() if it.row_map is not None else slice(None)
        ulp = ulp if it.row_map is None else torch.empty_like(ulp).index_copy_(0, perm, ulp)
        assert ((it.out.float() - want.float()).abs() <= ulp).all()
        assert (it.out == want).float().mean() > 0.99


def test_qkv_row_map_is_hf_order():
    from kora_trainer.backends.megatron.convert import Layout, fuse_qkv
    from kora_trainer.backends.megatron.sync import qkv_row_map

    layout = Layout(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=4)
    q, k, v = torch.randn(32, 5), torch.randn(8, 5), torch.randn(8, 5)
    fused = fuse_qkv(q, k, v, layout)
    hf = torch.empty_like(fused)
    hf[qkv_row_map(layout).long()] = fused
    assert torch.equal(hf, torch.cat([q, k, v]))


def _pair_of_groups():
    """Trainer rank 0 and engine rank 1 of a gloo weight-update group, each made on its own thread."""
    import threading

    from kora_trainer.wire.group import init_weight_update_group
    from kora_trainer.wire.ports import free_port

    port, out = free_port(), {}
    t = threading.Thread(target=lambda: out.setdefault(1, init_weight_update_group("127.0.0.1", port, 1, 2, "t")))
    t.start()
    out[0] = init_weight_update_group("127.0.0.1", port, 0, 2, "t")
    t.join()
    return out[0], out[1]


def _both(fn0, fn1):
    import threading

    errors = []

    def run(fn):
        try:
            fn()
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    t = threading.Thread(target=run, args=(fn1,))
    t.start()
    run(fn0)
    t.join(timeout=60)
    assert not errors, errors


def test_fast_merge_sync_over_gloo_lands_every_tensor():
    from kora_trainer.sync.fast import plan as fast
    from kora_trainer.wire import fast_receive
    from kora_trainer.wire.protocol import Assembler

    g = torch.Generator().manual_seed(0)
    qkv = _item(24, 16, 4, row_map=True, seed=5)  # a fused weight folded into q (16 rows), k, v (4 each)
    proj = _item(16, 16, 4, seed=6)
    embed = torch.randn(50, 16, generator=g).to(torch.bfloat16)  # larger than the cap: split into byte ranges
    norm = torch.randn(16, generator=g)  # another dtype in the same stream
    entries = [fast.PlainEntry("embed", embed),
               fast.FoldEntry([("q", (16, 16)), ("k", (4, 16)), ("v", (4, 16))], qkv.w, qkv.a, qkv.b, 0.5,
                              qkv.row_map),
               fast.FoldEntry([("o", (16, 16))], proj.w, proj.a, proj.b, 0.5), fast.PlainEntry("norm", norm)]
    plan = fast.MergePlan(entries, cap=1200)
    assert len(plan.buckets) > 2 and all(b.nbytes <= 1200 for b in plan.buckets)
    folded = _expected(qkv)
    want = {"embed": embed, "q": folded[:16], "k": folded[16:20], "v": folded[20:], "o": _expected(proj),
            "norm": norm}
    params = {n: torch.zeros_like(t) for n, t in want.items()}
    g0, g1 = _pair_of_groups()
    sender = fast.PipelinedSender(plan, g0)
    receiver = fast_receive.PipelinedReceiver(plan.metadata, params, g1)
    _both(lambda: (sender.push(), fast_receive.ack(g0)), lambda: (receiver.receive(), fast_receive.ack(g1)))
    for n, t in want.items():
        assert torch.equal(params[n], t), n
    # the buckets are the HTTP path's flattened_bucket format: protocol.Assembler reads them too
    asm, seen = Assembler(), {}
    for i, meta in enumerate(plan.metadata):
        seen.update(asm.feed(meta, sender.fill(i).clone()))
    assert not asm.incomplete and all(torch.equal(seen[n], t) for n, t in want.items())


def test_fast_adapter_push_and_flat_delta_over_gloo():
    from kora_engine.lm.lora_adapters import pair_lora_tensors
    from kora_trainer.sync.fast import adapter_pack as fast_adapter
    from kora_trainer.sync.fast import plan as fast
    from kora_trainer.wire import fast_receive

    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in [(4, 8), (12, 4), (4, 6),
                                                                                          (8, 4)]]
    flat = fast_adapter.flatten_parameters(params)
    assert fast_adapter.flat_view(params) is not None and fast_adapter.flat_view(params[::-1]) is None
    rows = torch.tensor([3, 0, 7, 5, 1, 2, 4, 6])
    specs = [fast.GatherSpec("base_model.model.m.q.lora_A.weight", params[0]),
             fast.GatherSpec("base_model.model.m.q.lora_B.weight", params[1], rows),
             fast.GatherSpec("base_model.model.m.k.lora_A.weight", params[0]),
             fast.GatherSpec("base_model.model.m.k.lora_B.weight", params[1], torch.arange(8, 12)),
             fast.GatherSpec("base_model.model.m.o.lora_A.weight", params[2]),
             fast.GatherSpec("base_model.model.m.o.lora_B.weight", params[3])]
    pack = fast_adapter.AdapterPack(params, specs, cap=200)
    assert len(pack.buckets) > 1
    g0, g1 = _pair_of_groups()
    ring = fast_receive.AdapterRing(pack.metadata, torch.device("cpu"), {"*": 2.0})
    got = {}
    _both(lambda: pack.push(g0), lambda: got.update(ring.receive(g1)))
    want = {"m.q": (params[0], params[1][rows]), "m.k": (params[0], params[1][8:]), "m.o": (params[2], params[3])}
    assert set(got) == set(want) and ring.rank == 4
    for module, (a, b) in want.items():
        assert torch.equal(got[module][0], a.detach()) and torch.equal(got[module][1], b.detach())
        assert got[module][2] == 2.0
    named = list(zip(pack.names, pack.out.split([s[0] * s[1] for s in pack.shapes]), strict=True))
    assert set(pair_lora_tensors([(n, t.view(s)) for (n, t), s in zip(named, pack.shapes, strict=True)])) == set(want)
    # the non-flat path (concatenate first) gives the same bytes
    loose = [p.detach().clone() for p in params]
    loose_specs = [fast.GatherSpec(s.name, loose[_which(params, s.src)], s.rows) for s in specs]
    pack2 = fast_adapter.AdapterPack(loose, loose_specs, cap=200)
    assert torch.equal(pack2.pack(), pack.pack())
    # delta-skip: inf before the first push, then the exact largest change
    delta = fast_adapter.FlatDelta(flat)
    assert delta.should_push(flat, 1e-6) == (True, float("inf"))
    delta.mark_pushed(flat)
    assert delta.should_push(flat, 1e-6) == (False, 0.0)
    with torch.no_grad():
        params[2][1, 3] += 0.5
    push, value = delta.should_push(flat, 1e-6)
    assert push and abs(value - 0.5) < 0.01


def _which(params, t):
    return [p.data_ptr() for p in params].index(t.data_ptr())
