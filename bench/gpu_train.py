"""Where a GPU step's time goes: N GRPO steps of the real trainer (`python -m kora_trainer.train`, the command a
user runs) on one GPU, backend megatron, Colocate (trainer and reference engine share the GPU), once per sync
mode, on a random-init checkpoint of a chosen shape written to local disk.

Per step, from the run's own event file (`events.jsonl`; recorder.py says what each field is): generate
(`gen_ms`), log-probs (`logprob_ms`, the no-grad forwards inside the update), train (`train_ms` less log-probs),
sync (the step's push, `sync.ms`), checkpoint (`checkpoint.interval` 1: every step), and the step's wall time
(between consecutive step events). Also sync's share of the step, tokens/s generated (samples x mean response
length / gen) and trained (prompt + response tokens / train), the run's `sync_paths`, and the peak GPU memory of
the trainer and engine processes (nvidia-smi, sampled every 0.5 s). Rewards: tests/e2e/toy_rewards.py's
odd-first-digit, which varies from the first step on an untrained model, so every step moves the adapter.

Anchors, measured in the same run on the same GPU by this process: one device copy of the model's bytes (a Merge
full push writes all of them) and of the adapted weights' bytes (a later Merge push rewrites only those), and of
the adapter's bytes (an Adapter push writes those once); and one fold of every adapted weight from a pristine copy
into another (`fold_adapted`: kernels/fold.GroupedFold, the kernel and graph an EngineMerge engine replays per
push), so an EngineMerge push is set against the copy of its A/B bytes plus its fold. Each step's push is split
into the phases the colocated sender reports (`sync_phases`, sync/fast/colocated.py); a verified push's checksum
call is there as `verify_ms`, outside `sync_ms`.

    PYTHONPATH=$PWD/trainer:$PWD/engine:$PWD/tests:/tmp/mc NCCL_NVLS_ENABLE=0 python bench/gpu_train.py \
        [--model qwen3-4b] [--engine reference|sglang]   # sglang: real SGLang 0.5.17 (hack/gpu_sglang_env.sh)
        [--modes Merge,Adapter,EngineMerge,Merge-http,Adapter-http] [--steps 4]
        [--out bench/results/gpu_train_DATE.json]
    python bench/gpu_train.py --model toy --backend torch --device cpu --steps 2   # CPU: plumbing only

Split over several GPUs (issue 22): `--set parallelism.tensor=2 --engines 2` (Colocate: an engine beside each
rank), `--deployment Disaggregated`; each mode's `loss_curve` and `world` are in the results, to set against the
same command at one GPU.

Shapes: `qwen3-4b` is Qwen3-4B's layers (hidden 2560, 36 layers, 32 heads / 8 KV heads of 128, MLP 9728) with
the toy's 16-token vocabulary, so the rollouts decode with the toy's tokenizer and its rewards score them (the
embedding and head are tiny; the step's cost is the layers'). LoRA rank 32 on q, k, v, o (linear_qkv,
linear_proj), as the sync benches.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "trainer", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, "rope_theta": 1e6,
                 "tie_word_embeddings": True},
    "toy": {},  # the toy as make_toy writes it (CPU plumbing check)
}
MIB = 1 << 20


def make_model(out: Path, shape: str, device: str) -> Path:
    """The toy's tokenizer and dataset (JSON lines: the GPU image has no pyarrow) with a random-init model of
    `shape` in bf16 (`toy`: the toy's own model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kora_trainer.toys.lm import make_toy, model_config

    marker = out / "bench_shape.json"
    if (out / "config.json").exists() and marker.exists() and json.loads(marker.read_text()) == {"shape": shape}:
        return out
    shutil.rmtree(out, ignore_errors=True)
    make_toy(out, target=0.0, dataset="train.jsonl")
    if SHAPES[shape]:
        toy = {k: v for k, v in model_config().to_dict().items() if k != "layer_types"}  # derived from the depth
        cfg = Qwen3Config(**{**toy, **SHAPES[shape], "dtype": "bfloat16"})
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        for f in out.glob("model*.safetensors"):
            f.unlink()
        model.save_pretrained(out)
        del model
    (out / "bench_shape.json").write_text(json.dumps({"shape": shape}))
    return out


class GpuMemory:
    """Peak used GPU memory per process (MiB), sampled with nvidia-smi every `every` seconds."""

    def __init__(self, every: float = 0.5):
        self.every, self.peak = every, {}  # type: ignore[var-annotated]
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def __enter__(self) -> GpuMemory:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True, check=False).stdout
            for line in out.splitlines():
                try:
                    pid, mib = (int(x) for x in line.split(","))
                except ValueError:
                    continue
                self.peak[pid] = max(self.peak.get(pid, 0), mib)
                if pid not in self.names:
                    try:
                        self.names[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                    except OSError:
                        self.names[pid] = "?"

    def by_role(self) -> dict[str, int]:
        roles: dict[str, int] = {}
        for pid, mib in self.peak.items():
            name = self.names.get(pid, "")
            role = "engine" if "kora_engine" in name else "trainer" if "TrainWorker" in name or "ray::" in name \
                else "other"
            roles[role] = roles.get(role, 0) + mib
        return roles


def copy_ms(nbytes: int, device: torch.device, reps: int = 20) -> float | None:
    """Median CUDA-event time of one device copy of nbytes (None on CPU)."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[2:])


def fold_ms(model_dir: Path, device: torch.device, rank: int = 32, reps: int = 20) -> dict[str, float] | None:
    """One replay of the grouped fold of every adapted weight (q, k, v, o: W0 + s·B·A from a pristine copy into
    the live weight, rank `rank`, bf16) — what an EngineMerge engine runs per push: the median CUDA-event time
    (`device`) and the median host time from before the replay to its synchronise's return (`host`: the
    replay's launch and the synchronise included, as a push pays them)."""
    from safetensors import safe_open

    from kora_trainer.kernels.fold import FoldItem, GroupedFold

    if device.type != "cuda":
        return None
    shapes = []
    for f in model_dir.glob("model*.safetensors"):
        with safe_open(str(f), "pt") as st:
            shapes += [st.get_slice(n).get_shape() for n in st.keys()  # noqa: SIM118 (safe_open has no __iter__)
                       if any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    bf16 = {"dtype": torch.bfloat16, "device": device}
    items = [FoldItem(torch.randn(m, n, **bf16), torch.empty(m, n, **bf16), torch.randn(rank, n, **bf16),
                      torch.randn(m, rank, **bf16), 2.0) for m, n in shapes]
    fold = GroupedFold(items)
    fold.prepare()
    times, host = [], []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fold()
        b.record()
        b.synchronize()
        host.append((time.perf_counter() - t0) * 1000)
        times.append(a.elapsed_time(b))
    del items, fold
    torch.cuda.empty_cache()
    return {"device": statistics.median(times[2:]), "host": statistics.median(host[2:])}


def model_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of every weight, and of the weights LoRA adapts (q, k, v, o) and of the rank-32 adapter on them."""
    from safetensors import safe_open

    total = adapted = adapter = 0
    for f in model_dir.glob("model*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = st.get_slice(name)
                shape, n = t.get_shape(), 2
                for d in shape:
                    n *= d
                total += n
                if any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
                    adapted += n
                    adapter += 2 * 32 * (shape[0] + shape[1])  # A [32, in] + B [out, 32], bf16
    return {"model": total, "adapted": adapted, "adapter": adapter}


def run_mode(model_dir: Path, label: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run; `label` is a sync mode, or a mode with "-http" (sync.fastPath false: the HTTP path's figures and
    its engine-vs-trainer gap, to compare with the fast path's)."""
    mode, _, http = label.partition("-")
    run_dir = work / f"run-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    gpu = args.device == "cuda"
    cmd = [sys.executable, "-m", "kora_trainer.train", "--config", str(ROOT / "trainer" / "examples" / "toy.yaml"),
           "--run-dir", str(run_dir), "--control-port", "0", f"model.path={model_dir}",
           f"data.path={model_dir}/train.jsonl", f"backend={args.backend}", f"deployment.mode={args.deployment}",
           "deployment.async=false", f"lora.syncMode={mode}", "lora.rank=32", "lora.alpha=64",
           "lora.targetModules=[linear_qkv,linear_proj]", f"algorithm.numSteps={args.steps}",
           f"algorithm.rolloutBatchSize={args.prompts}", f"algorithm.nSamplesPerPrompt={args.samples}",
           f"algorithm.globalBatchSize={args.prompts * args.samples}", f"algorithm.maxNewTokens={args.max_new_tokens}",
           "sync.deltaSkipThreshold=0", "data.rewardType=custom", "data.customRewardPath=toy_rewards.odd_first_digit",
           f"checkpoint.path={run_dir / 'ckpt'}", "checkpoint.interval=1",
           f"rollout.gpusPerEngine={1 if gpu else 0}", f"rollout.numEngines={args.engines}",
           f"sync.fastPath={'false' if http else 'true'}", f"sync.bufferSize={args.buffer_size}",
           *engine_overrides(args), *args.set]
    # the e2e tests' reward (tests/e2e/toy_rewards.py): it varies from the first step on an untrained model, so
    # every step has advantages, the adapter moves and every sync pushes
    path = os.pathsep.join([str(ROOT / "tests" / "e2e"), str(ROOT / "trainer"), str(ROOT / "engine"),
                            os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "KORA_CONTROL_TOKEN": "bench", "PYTHONPATH": path}
    t0 = time.monotonic()
    with GpuMemory() as mem:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=args.timeout)
    wall = time.monotonic() - t0
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()] \
        if (run_dir / "events.jsonl").exists() else []
    if proc.returncode != 0 or not events:
        return {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
    steps = [e for e in events if e["event"] == "step"]
    ckpt = {e["step"]: e["ms"] for e in events if e["event"] == "checkpoint"}
    summary = next(e for e in events if e["event"] == "summary")
    start = next(e for e in events if e["event"] == "start")
    rows, prev = [], start["wall_s"]
    for e in steps:
        row = {"step": e["step"], "generate_ms": e["gen_ms"], "logprob_ms": e.get("logprob_ms", 0.0),
               "train_ms": round(e["train_ms"] - e.get("logprob_ms", 0.0), 1), "sync_ms": e["sync"]["ms"],
               "sync_what": e["sync"]["what"], "sync_path": e["sync"]["path"], "sync_phases": e["sync"].get("phases"),
               "checkpoint_ms": ckpt.get(e["step"]),
               "step_ms": round((e["wall_s"] - prev) * 1000, 1), "tokens": e.get("tokens"),
               "generated_tokens": round(e.get("samples", 0) * e.get("response_len", 0.0)),
               "served_gap": e.get("rollout_logp_gap_max"), "stale_gap": e.get("stale_logp_gap_max")}
        prev = e["wall_s"]
        rows.append(row)
    later = rows[1:] or rows  # step 1 carries the first fast push (Merge: full) and warm-up
    med = {k: statistics.median(r[k] or 0.0 for r in later) for k in
           ("generate_ms", "logprob_ms", "train_ms", "sync_ms", "checkpoint_ms", "step_ms")}
    return {
        "command": " ".join(cmd[1:]), "wall_s": round(wall, 1), "steps": rows, "median_after_step1": med,
        "sync_share_of_step": round(med["sync_ms"] / med["step_ms"], 5) if med["step_ms"] else None,
        "tokens_per_s_generated": round(statistics.median(r["generated_tokens"] / r["generate_ms"] * 1000
                                                          for r in later), 1),
        "tokens_per_s_trained": round(statistics.median((r["tokens"] or 0) / max(r["train_ms"] + r["logprob_ms"], 1e-9)
                                                        * 1000 for r in later), 1),
        "sync_paths": summary.get("sync_paths"), "loss_curve": summary.get("loss_curve"),
        "world": start.get("world"), "transport": start.get("transport"),
        # the push before step 1 (the initial policy: Merge's whole model, Adapter's base + adapter); steps push after
        "first_push": {k: start.get("sync", {}).get(k) for k in ("what", "ms", "bytes", "buckets", "phases")},
        "notes": [e["sync"]["note"] for e in [start, *steps] if e["sync"].get("note")],
        "rollout_logp_gap_max": summary.get("rollout_logp_gap_max"),
        "peak_gpu_mib": mem.by_role() if mem.available else "nvidia-smi not found",
        "engine_http_status": engine_statuses(run_dir),
    }


ACCESS = re.compile(r'"(?:GET|POST) (/[^ ?"]*)[^"]*" (\d{3})')


def engine_statuses(run_dir: Path) -> dict[str, int]:
    """How many requests SGLang's access log answered with each status, per route (`/route status`): the trainer
    must get a 2xx for every one. SGLang answers its start-up readiness probes 503 by design (until ready), so
    /health 503s before the first /generate are left out, as tests/gpu/test_train_sglang.engine_calls does. The
    reference engine logs no access lines: {}."""
    counts: collections.Counter[str] = collections.Counter()
    for log in sorted((run_dir / "logs").glob("engine-*.log")):
        calls = ACCESS.findall(log.read_text(errors="replace"))
        first = next((i for i, c in enumerate(calls) if c[0] == "/generate"), len(calls))
        counts.update(f"{r} {c}" for i, (r, c) in enumerate(calls) if not (i < first and r == "/health" and c == "503"))
    return dict(sorted(counts.items()))


# the kernels the carried SGLang 0.5.17 has on the device (hack/sglang_carry.sh: no FA3, no flashinfer JIT sources)
SGLANG_KERNELS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--lora-backend", "triton"]


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """`--engine sglang`: real SGLang 0.5.17 (rollout.sglangBuild), its kernels and CUDA graphs up to the batch."""
    if args.engine != "sglang":
        return []
    # quoted: the override is a YAML list of strings (an unquoted 64 is an int, refused)
    flags = [*SGLANG_KERNELS, "--cuda-graph-max-bs", f"'{args.prompts * args.samples}'"]
    return ["rollout.engine=sglang", "rollout.sglangBuild=0.5.17", f"rollout.sglangArgs=[{','.join(flags)}]"]


def sglang_alone(model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The anchor for generation: SGLang 0.5.17 started alone with the flags the trainer's engine had (the same
    deterministic-inference switch: these runs checkpoint without async, so rollouts are reproducible and each
    sample is its own request with its own sampling_seed), the same batch sent at once, tokens/s of the answers."""
    import urllib.request

    from kora_trainer.wire.ports import free_port

    port = free_port()
    prompts = [json.loads(line)["prompt"] for line in (model_dir / "train.jsonl").read_text().splitlines()]
    prompts = prompts[:args.prompts]
    flags = [*SGLANG_KERNELS, "--cuda-graph-max-bs", str(args.prompts * args.samples),
             "--enable-deterministic-inference"]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--mem-fraction-static", "0.5", *flags]
    log = open(work / "sglang-alone.log", "w")  # noqa: SIM115 - held for the server's life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def post(body: dict[str, Any]) -> Any:
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=600).read())

    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(url + "/health_generate", timeout=5)
                break
            except OSError:
                time.sleep(1)
        else:
            return {"error": "sglang did not start", "log": (work / "sglang-alone.log").read_text()[-2000:]}
        from concurrent.futures import ThreadPoolExecutor

        bodies = [{"text": p, "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                                                  "sampling_seed": i * args.samples + j}}
                  for i, p in enumerate(prompts) for j in range(args.samples)]
        rates = []
        with ThreadPoolExecutor(len(bodies)) as pool:
            list(pool.map(post, bodies[:8]))  # warm
            for _ in range(3):
                t = time.perf_counter()
                outs = list(pool.map(post, bodies))
                rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t))
        return {"tokens_per_s": round(statistics.median(rates), 1), "runs": [round(r, 1) for r in rates],
                "requests": len(bodies), "command": " ".join(cmd[1:])}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen3-4b")
    ap.add_argument("--modes", default="Merge,Adapter,EngineMerge,Merge-http,Adapter-http",
                    help="sync modes; MODE-http runs it with sync.fastPath false")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--backend", default="megatron")
    ap.add_argument("--engine", choices=["reference", "sglang"], default="reference",
                    help="kora's reference engine, or real SGLang 0.5.17 (hack/gpu_sglang_env.sh; Merge, Adapter)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--deployment", choices=["Colocate", "Disaggregated"], default="Colocate")
    ap.add_argument("--engines", type=int, default=1, help="rollout.numEngines")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further override of every run (e.g. parallelism.tensor=2; repeat it)")
    # the product's default cap, not the toy recipe's 1Mi (which exists to make a toy model span several buckets:
    # at the 4B shape it sent every tensor in its own call)
    from kora_trainer.config.sections import SyncSpec  # after the sys.path set-up above

    ap.add_argument("--buffer-size", default=str(SyncSpec().buffer_size),
                    help="sync.bufferSize: the largest in-memory / broadcast call (default: the product's)")
    ap.add_argument("--workdir", default="/tmp/kora-gpu-train")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    t0 = time.monotonic()
    model_dir = make_model(work / f"model-{args.model}", args.model, args.device)
    sizes = model_bytes(model_dir)
    res: dict[str, Any] = {
        "bench": "gpu_train", "command": "python bench/gpu_train.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "model": args.model,
        "model_write_s": round(time.monotonic() - t0, 1), "bytes": sizes,
        "anchors_ms": {f"copy_{k}": copy_ms(v, device) for k, v in sizes.items()}, "modes": {}}
    fold = fold_ms(model_dir, device)
    res["anchors_ms"].update(fold_adapted=fold and fold["device"], fold_adapted_host=fold and fold["host"])
    for mode in filter(None, args.modes.split(",")):  # --modes "" --engine sglang: SGLang's own anchor alone
        res["modes"][mode] = run_mode(model_dir, mode, args, work)
        print(json.dumps({mode: {k: v for k, v in res["modes"][mode].items() if k != "steps"}}, indent=1), flush=True)
        if args.out:
            args.out.write_text(json.dumps(res, indent=2) + "\n")
    if args.engine == "sglang":
        res["sglang_alone"] = sglang_alone(model_dir, args, work)
        print(json.dumps({"sglang_alone": res["sglang_alone"]}), flush=True)
    ratios = {}
    for mode, r in res["modes"].items():
        alone = res.get("sglang_alone", {}).get("tokens_per_s")
        if "steps" in r and alone:
            ratios[f"{mode}_generated_over_sglang_alone"] = round(r["tokens_per_s_generated"] / alone, 3)
        if "steps" not in r:
            continue
        later = r["steps"][1:]
        anchors = res["anchors_ms"]
        full = r["first_push"] if r["first_push"].get("what") == "full" else None
        if mode == "Merge" and anchors["copy_model"]:
            if full and full.get("ms"):
                ratios["merge_full_push_over_copy_model"] = round(full["ms"] / anchors["copy_model"], 3)
            if later:
                ratios["merge_push_over_copy_adapted"] = round(statistics.median(x["sync_ms"] for x in later)
                                                               / anchors["copy_adapted"], 3)
        if mode == "Adapter" and later:
            ratios["adapter_push_p50_ms"] = statistics.median(x["sync_ms"] for x in later)
        if mode == "EngineMerge" and later and anchors["fold_adapted"]:
            push = statistics.median(x["sync_ms"] for x in later)
            ratios["enginemerge_push_over_copy_adapter_plus_fold"] = round(
                push / (anchors["copy_adapter"] + anchors["fold_adapted"]), 3)
            ratios["enginemerge_push_over_copy_adapter_plus_fold_host"] = round(
                push / (anchors["copy_adapter"] + anchors["fold_adapted_host"]), 3)
    res["ratios"] = ratios
    print(json.dumps({"anchors_ms": res["anchors_ms"], "ratios": ratios}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
