"""Benchmark `kora merge` against peft's merge_and_unload() + save_pretrained, and the disk floor.

Builds a random-initialised Qwen3-shaped checkpoint of >= 2 GB in bf16 (sharded) and a rank-16
PEFT adapter on every projection, then measures, each in its own process:
  kora   : kora merge (streams tensor by tensor)
  peft   : AutoModelForCausalLM + PeftModel.from_pretrained + merge_and_unload + save_pretrained
  copy   : copying the same shard bytes (the disk floor)
and prints one JSON object with times, peak RSS and the ratios kora/peft and kora/copy.

    python bench/merge.py [--workdir DIR] [--layers 18] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Peak RSS from /proc/self/status VmHWM: unlike getrusage's ru_maxrss it is not inherited across
# exec, so a child started by a big parent reports its own peak.
CHILD_PREFIX = "import sys, time, json\nt0 = time.perf_counter()\n"
CHILD_SUFFIX = (
    "\nhwm = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM'))"
    "\nprint(json.dumps({'seconds': time.perf_counter() - t0, 'peak_rss_mb': hwm / 1024}))\n"
)


def run_child(code: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD_PREFIX + code + CHILD_SUFFIX], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def build(work: Path, layers: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(work / "base", max_shard_size="600MB")
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    peft_model.save_pretrained(work / "adapter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=20, help="20 layers -> ~2.3 GB in bf16")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kora-bench-merge-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if not (work / "adapter" / "adapter_config.json").exists():
            t = time.perf_counter()  # built in a child so this process stays small
            run_child(f"sys.path.insert(0, {str(Path(__file__).parent)!r})\nfrom merge import build\n"
                      f"from pathlib import Path\nbuild(Path({str(work)!r}), {args.layers})\n")
            print(f"built synthetic checkpoint in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        shards = sorted((work / "base").glob("*.safetensors"))
        total = sum(s.stat().st_size for s in shards)
        largest = max(s.stat().st_size for s in shards)

        copy_dir = work / "copy"
        shutil.rmtree(copy_dir, ignore_errors=True)
        copy = run_child(f"import shutil, pathlib\nd = pathlib.Path({str(copy_dir)!r}); d.mkdir()\n"
                         f"for s in {[str(s) for s in shards]!r}: shutil.copyfile(s, d / pathlib.Path(s).name)\n")
        shutil.rmtree(copy_dir, ignore_errors=True)

        kora = run_child("from pathlib import Path\nfrom kora_trainer.checkpoint.merge import merge\n"
                         f"merge(Path({str(work / 'base')!r}), Path({str(work / 'adapter')!r}), "
                         f"Path({str(work / 'kora_out')!r}), force=True, progress=False)\n")
        peft = run_child("import torch\nfrom transformers import AutoModelForCausalLM\nfrom peft import PeftModel\n"
                         f"m = AutoModelForCausalLM.from_pretrained({str(work / 'base')!r}, dtype=torch.bfloat16)\n"
                         f"m = PeftModel.from_pretrained(m, {str(work / 'adapter')!r}).merge_and_unload()\n"
                         f"m.save_pretrained({str(work / 'peft_out')!r}, max_shard_size='600MB')\n")
        result = {
            "bench": "merge", "checkpoint_bytes": total, "shards": len(shards), "largest_shard_mb": largest / 2**20,
            "kora_s": kora["seconds"], "kora_peak_rss_mb": kora["peak_rss_mb"],
            "peft_s": peft["seconds"], "peft_peak_rss_mb": peft["peak_rss_mb"],
            "copy_s": copy["seconds"], "copy_peak_rss_mb": copy["peak_rss_mb"],
            "kora_vs_peft_time": kora["seconds"] / peft["seconds"],
            "kora_vs_copy_time": kora["seconds"] / copy["seconds"],
            "kora_rss_bound_mb": largest / 2**20 + 300,
            "kora_rss_within_bound": kora["peak_rss_mb"] <= largest / 2**20 + 300,
        }
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
