"""Shared helpers for the engine tests: start the reference engine as a real process, build PEFT
adapters with `peft` itself, compute reference log-probs with plain transformers forwards, and
play the trainer's side of a weight push (rank 0 of a real gloo group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kora_trainer.wire.colocated_words import ARM, ARM_SLOT, SPUN, WARMED, wait_word
from kora_trainer.wire.engine_client import EngineClient
from kora_trainer.wire.group import WeightUpdateGroup, init_weight_update_group
from kora_trainer.wire.ports import free_port
from kora_trainer.wire.protocol import FLAT, Bucket, pack, plan_buckets
from kora_trainer.wire.serialize import serialize_named_tensors, serialize_tensor_dict
from localcluster import wait_for

PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 12, 13, 3, 14], [1, 9, 9, 13, 9, 9, 14, 4]]
ATOL = 1e-4  # fp32 engine vs fp32 reference forward: batching/padding/KV-cache change summation order only


@dataclass
class EngineProc:
    proc: subprocess.Popen
    url: str
    log: Path

    def client(self, **kw: object) -> EngineClient:
        return EngineClient(self.url, **kw)  # type: ignore[arg-type]


def start_engine(model_dir: Path, log_dir: Path, *extra: str, device: str = "cpu",
                 timeout_s: float = 120.0, env: dict[str, str] | None = None) -> EngineProc:
    """`python -m kora_engine.lm` on a free port, `env` added to its environment; waits
    (bounded) for /health."""
    port = free_port()
    log = log_dir / f"engine-{port}.log"
    cmd = [sys.executable, "-m", "kora_engine.lm", "--model-path", str(model_dir),
           "--port", str(port), "--device", device, "--num-threads", "1", *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    engine = EngineProc(proc, f"http://127.0.0.1:{port}", log)
    try:
        with engine.client() as c:
            c.wait_healthy(timeout_s=timeout_s)
    except TimeoutError:
        stop_engine(engine)
        raise RuntimeError(f"engine did not start:\n{log.read_text()[-3000:]}") from None
    return engine


def stop_engine(engine: EngineProc) -> None:
    engine.proc.terminate()
    try:
        engine.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        engine.proc.kill()
        engine.proc.wait(timeout=10)


@contextmanager
def served_engine(model_dir: Path, log_dir: Path, *extra: str, key: str | None = None,
                  timeout: float = 120.0) -> Iterator[tuple[EngineProc, EngineClient]]:
    """`start_engine` and a client holding `key` (as api key: the one key it sends everywhere); stopped after."""
    engine = start_engine(model_dir, log_dir, *extra)
    try:
        with EngineClient(engine.url, api_key=key, timeout=timeout) as client:
            yield engine, client
    finally:
        stop_engine(engine)


def wait_engine_state(client: EngineClient, what: str, timeout_s: float = 30.0, **expected: int) -> None:
    """Bounded wait until the engine's GET /kora/state shows `expected` (e.g. receiving=1)."""
    def reached() -> bool:
        state = client.request("GET", "/kora/state")
        return all(state[key] == value for key, value in expected.items())

    wait_for(reached, timeout=timeout_s, interval=0.02, what=what)


def load_hf(model_dir: Path, device: str = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: Sequence[int], output_ids: Sequence[int]) -> list[float]:
    """log p(output token t | prompt, outputs < t) from one plain forward over prompt + output."""
    ids = torch.tensor([list(prompt) + list(output_ids)], device=next(model.parameters()).device)
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [T, V]
    start = len(prompt) - 1
    return [float(logp[start + i, tok]) for i, tok in enumerate(output_ids)]


def make_peft_adapter(model_dir: Path, out_dir: Path, seed: int, r: int = 4, alpha: float = 8.0,
                      targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"), device: str = "cpu",
                      ) -> tuple[Path, torch.nn.Module]:
    """A LoRA adapter made by `peft` itself (B non-zero so it changes the output), saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets))
    peft_model = get_peft_model(load_hf(model_dir, device), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir, peft_model.eval()


def peft_tensors(peft_model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapter as PEFT saves it: base_model.model.<module>.lora_A.weight, ..."""
    from peft import get_peft_model_state_dict

    return [(k, v.detach().clone()) for k, v in get_peft_model_state_dict(peft_model).items()]


def peft_config_dict(peft_model: torch.nn.Module) -> dict:
    """adapter_config.json's contents (JSON-safe: sets become sorted lists)."""
    return json.loads(json.dumps(peft_model.peft_config["default"].to_dict(),
                                 default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def random_weights(model: torch.nn.Module, seed: int,
                   names: Sequence[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    return [(n, torch.randn(params[n].shape, generator=g) * 0.2) for n in (names or list(params))]


@contextmanager
def trainer_group(client: EngineClient, group_name: str = "weight_update_group",
                  backend: str = "gloo") -> Iterator[WeightUpdateGroup]:
    """The test process as trainer rank 0, the engine as rank 1 (gloo on CPU, nccl on GPU)."""
    port = free_port()
    fut = client.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, group_name, backend)
    group = init_weight_update_group("127.0.0.1", port, 0, 2, group_name, backend, timeout_s=60)
    assert fut.result(timeout=60)["success"]
    try:
        yield group
    finally:
        client.destroy_weights_update_group(group_name)


def broadcast_bucket(group: WeightUpdateGroup, bucket: Bucket, tensors: dict[str, torch.Tensor],
                     load_format: str | None) -> None:
    if load_format == FLAT:
        group.broadcast(pack(bucket, tensors, group.device))
    else:
        for name in bucket.metadata()["names"]:
            group.broadcast(tensors[name].detach().to(group.device).contiguous())


def push_weights(client: EngineClient, group: WeightUpdateGroup, named: list[tuple[str, torch.Tensor]], cap: int,
                 load_format: str | None, **fields: object) -> list[dict]:
    """The trainer's side of a full-weight push: one HTTP call (in a thread) + one broadcast per bucket."""
    tensors = dict(named)
    results = []
    for bucket in plan_buckets([[nt] for nt in named], cap):
        fut = client.submit(client.update_weights_from_distributed, bucket.metadata(), load_format=load_format,
                            **fields)
        broadcast_bucket(group, bucket, tensors, load_format)
        results.append(fut.result(timeout=60))
    return results


def publish_adapter(client: EngineClient, group: WeightUpdateGroup, name: str, peft_model: torch.nn.Module,
                    version: str) -> dict:
    """The trainer's side of one adapter version over the group (one bucket): call, broadcast, wait."""
    named = peft_tensors(peft_model)
    bucket = plan_buckets([named], 1 << 22)[0]
    fut = client.submit(client.load_lora_adapter_from_distributed, name, peft_config_dict(peft_model),
                        bucket.metadata(), weight_version=version)
    broadcast_bucket(group, bucket, dict(named), FLAT)
    return fut.result(timeout=60)


def serialize_adapter(peft_model: torch.nn.Module) -> str:
    """The adapter as /load_lora_adapter_from_tensors takes it in SGLang: a {name: tensor} dict."""
    return serialize_tensor_dict(peft_tensors(peft_model))


def retire_and_reload(client: EngineClient, name: str, model: torch.nn.Module) -> None:
    """What sync/slot_sender.SlotSender.retire sends (abort by the rid prefix, the in-flight count, unload), then
    the next adapter's load under the freed name."""
    client.abort_request(f"{name}::", prefix=True)
    wait_for(lambda: f"{name}::" not in client.kora_state()["in_flight_by_rid_prefix"], timeout=30.0, interval=0.02,
             what=f"no {name}:: request in flight")
    client.unload_lora_adapter(name)
    client.load_lora_adapter_from_tensors(name, peft_config_dict(model), serialize_adapter(model))


def engine_vs_reference(client: EngineClient, reference: torch.nn.Module, lora_path: str | None = None,
                        prompts: Sequence[Sequence[int]] = PROMPTS, max_new_tokens: int = 4) -> float:
    """Largest |engine log-prob - reference log-prob| over greedy continuations of `prompts`."""
    outs = client.generate(prompts, {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
                           lora_path=lora_path)
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = reference_logprobs(reference, prompt, out.output_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)))
    return worst


def trained_policy(model_dir: Path, mode: str, seed: int, cap: int | str,
                   targets: str = "[linear_qkv, linear_proj, linear_fc1, linear_fc2]", device: str = "cpu") -> Any:
    """A TorchBackend on the tiny model (on `device`) with a trained-looking adapter (B != 0), ready to sync."""
    from kora_trainer.backends.torch_backend import TorchBackend
    from kora_trainer.config import load_config

    cfg, _ = load_config(None, [f"model.path={model_dir}", "data.path=unused.parquet", "lora.rank=4",
                                "lora.alpha=8", f"lora.syncMode={mode}", f"sync.bufferSize={cap}",
                                f"lora.targetModules={targets}", "rollout.engine=hf"])
    b = TorchBackend(cfg, device=device, threads=1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in b.params:
            p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.1)
    return b


def logprob_gap(client: EngineClient, b: Any, lora_path: str | None) -> float:
    """Largest |engine − trainer| log-prob over greedy continuations of the fixed prompts."""
    outs = client.generate(PROMPTS, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                           lora_path=lora_path)
    ours = b.logprobs(PROMPTS, [o.output_ids for o in outs])
    return max(abs(x - y) for o, mine in zip(outs, ours, strict=True)
               for x, y in zip(o.output_logprobs, mine, strict=True))


@contextmanager
def kora_and_sglang_like(tmp_path_factory: Any) -> Iterator[tuple[Path, dict[str, EngineProc]]]:
    """(a tiny model, {"kora": the reference engine serving it, "sglang_like": the same without kora's fast-sync
    and colocated routes, answering them 404 as a stock SGLang does}): the fast-path tests' engines."""
    from tinymodel import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    logs, up = tmp_path_factory.mktemp("logs"), {}
    try:
        up["kora"] = start_engine(model, logs, "--max-lora-rank", "8")
        up["sglang_like"] = start_engine(model, logs, "--max-lora-rank", "8", "--disable-fast-sync")
        yield model, up
    finally:
        for proc in up.values():
            stop_engine(proc)


@contextmanager
def recording_engine(tmp_path_factory: Any, *extra: str, device: str = "cpu"
                     ) -> Iterator[tuple[Path, EngineProc, Path]]:
    """(a tiny model, the reference engine serving it, the JSON-lines file of every HTTP request it answered:
    kora_engine/lm/record.py); stopped after."""
    from kora_engine.lm.record import RECORD_ENV
    from tinymodel import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    logs = tmp_path_factory.mktemp("logs")
    record = logs / "calls.jsonl"
    engine = start_engine(model, logs, "--max-lora-rank", "8", *extra, device=device, env={RECORD_ENV: str(record)})
    try:
        yield model, engine, record
    finally:
        stop_engine(engine)


def reset_to_checkpoint(engine: EngineProc, model_dir: Path) -> None:
    """The engine's weights back to the checkpoint's, version "default" (a Merge push makes the merged weights the
    engine's base, as it should: an EngineMerge policy pushed after it would be folded onto them)."""
    named = [(n, p.detach()) for n, p in load_hf(model_dir).named_parameters()]
    with engine.client() as client:
        client.update_weights_from_tensor(serialize_named_tensors(named), weight_version="default")


def recorded_calls(record: Path) -> list[dict[str, Any]]:
    """What a `recording_engine` answered so far, in order (method, path, status, body)."""
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def steady_state_pushes(sender: Any, b: Any, client: EngineClient, record: Path, versions: Sequence[int],
                        lora_path: str | None, atol: float, prelaunch: bool = False) -> list[float]:
    """Push each of `versions` (the adapter moved before each, odd ones armed) through a colocated fast `sender`
    whose plan and first fast push are done: each push makes no HTTP call to the `recording_engine`, which then
    serves the policy (log-prob gap < atol) at that version. With `prelaunch` (an EngineMerge engine on a GPU
    that waits on the handshake's GATE word) an armed push's gather and fold were enqueued at its arm. Returns the
    pushes' ms."""
    times = []
    for version in versions:
        step(b, 0.05 if version % 2 else -0.04)
        armed = version % 2 == 1 and sender.engine_gathers  # EngineMerge's engines warm up for an armed push
        if version % 2:  # as the trainer's step does (orchestration/workers.py); even versions come unannounced
            sender.arm()
        if armed:  # the warm-up done before the request, as at the end of a training step
            for words in sender.hand.words:
                wait_word(words, WARMED, lambda v: v == sender.hand.seq + 1, 30, "the engine's warm-up")
        before = len(recorded_calls(record))
        report = sender.sync(version=version)
        made = recorded_calls(record)[before:]
        assert report.pushed and report.path == "fast" and report.adapter_version == version, report
        if armed:  # the request found the watcher awake and spinning (wire/colocated_words.py ARM)
            assert report.phases["engine_spun"] == 1.0 and report.phases["engine_warmed_ahead"] >= 0, report.phases
            assert report.phases["engine_prelaunched"] == float(prelaunch), report.phases
        elif sender.engine_gathers:  # asleep: unannounced (or armed once before, and that arm ran out)
            assert report.phases.get("engine_spun", 0.0) == 0.0, report.phases
        assert made == [], f"a steady-state {sender.mode} push made HTTP calls: {made}"
        times.append(report.ms)
        assert logprob_gap(client, b, lora_path) < atol  # the engine serves the pushed policy
        out = client.generate([PROMPTS[0]], {"max_new_tokens": 1}, lora_path=lora_path)
        assert out[0].weight_version == str(version)
    return times


def on_hf_engines(b: Any) -> None:
    """Point a `trained_policy` backend's config at kora's hf engine (the fast paths' condition)."""
    from kora_trainer.config.sections import Engine

    b.cfg = b.cfg.model_copy(update={"rollout": b.cfg.rollout.model_copy(update={"engine": Engine.HF})})


def colocated_sender(b: Any, client: EngineClient, transport_timeout_s: float = 60.0) -> Any:
    """The trainer's colocated fast sender (sync/fast/colocated.py) for a `trained_policy` backend, on `client`."""
    from kora_trainer.sync.fast.colocated import ColocatedFastSender
    from kora_trainer.sync.fast.path import with_fast_path
    from kora_trainer.sync.sender import WeightSender
    from kora_trainer.sync.transport import ColocatedTransport

    on_hf_engines(b)
    sender = with_fast_path(WeightSender(b.model, b.cfg, ColocatedTransport([client], transport_timeout_s)), b.cfg)
    assert isinstance(sender, ColocatedFastSender)
    return sender


def greedy(client: EngineClient) -> list[tuple[str | None, list[int], list[float]]]:
    """What the engine serves: greedy continuations of the fixed prompts, their log-probs and version."""
    outs = client.generate(PROMPTS, {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    return [(o.weight_version, list(o.output_ids), list(o.output_logprobs)) for o in outs]


def skip_under_threshold_keeps_what_is_served(sender: Any, b: Any, client: EngineClient, version: int) -> Any:
    """Move the adapter a little, under a raised delta threshold, and sync as `version`: a delta-skip, and the
    engine serves exactly what it served before (weights, to the bit, and version), though an EngineMerge engine
    gathered and folded the moved pairs before its decision (EngineMergeMode.fold_on_engine) and put them back."""
    served = greedy(client)
    threshold, sender.threshold = sender.threshold, 1.0
    try:
        step(b, 1e-3)
        sender.arm()  # as the trainer's step does: the engine warms on the slot it then decides to skip
        report = sender.sync(version=version)
    finally:
        sender.threshold = threshold
    assert not report.pushed and 0 < report.max_delta < 1.0, report
    assert greedy(client) == served
    return report


def armed_push_that_never_comes(sender: Any, b: Any, client: EngineClient) -> None:
    """Arm a push and never make it (a trainer that died between its step and its push): the arm holds the
    engine's weights (on a GPU with the moved adapter's gather and fold enqueued) until ARM_S passes, then is
    undone — a generation asked meanwhile waits for that, then gets what was served before, to the bit, at the
    same version."""
    served = greedy(client)
    step(b, 0.05)
    sender.arm()
    n = sender.hand.seq + 1
    for words in sender.hand.words:
        wait_word(words, WARMED, lambda v: v == n, 30, "the engine's warm-up")
    with ThreadPoolExecutor(1) as pool:  # asked while armed: it runs only once the engine gave up (SPUN -n)
        held = pool.submit(greedy, client).result(timeout=60)
        assert [words[SPUN] for words in sender.hand.words] == [-n] * len(sender.hand.words), "served while armed"
    assert held == served
    assert greedy(client) == served  # (a request number is armed once: the next push should come unannounced)


def misarmed_push(sender: Any, b: Any, client: EngineClient, version: int, atol: float) -> Any:
    """Arm the next push on another ring slot than the one it names (what kora's trainer never does; with
    EngineMerge's two slots, the one that holds what is served): the engine neither warms nor prelaunches it (it
    would overwrite the delta's reference), and the push still decides right and serves the pushed policy."""
    step(b, 0.03)
    for words in sender.hand.words:
        words[ARM_SLOT] = (sender.pushes + 1) % sender.adapter_slots
        words[ARM] = sender.hand.seq + 1
    for wake in sender.hand.wakers:
        wake()
    for words in sender.hand.words:
        wait_word(words, WARMED, lambda v: v == sender.hand.seq + 1, 30, "the engine's warm-up")
    report = sender.sync(version=version)
    assert report.pushed and report.phases["engine_spun"] == 1.0, report
    assert report.phases["engine_prelaunched"] == 0.0, report.phases
    assert logprob_gap(client, b, None) < atol
    assert client.generate([PROMPTS[0]], {"max_new_tokens": 1})[0].weight_version == str(version)
    return report


def step(b: Any, by: float = 0.05) -> None:
    """A stand-in optimizer step: every adapter parameter moves by `by`."""
    with torch.no_grad():
        for p in b.params:
            p.add_(by)
