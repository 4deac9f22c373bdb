"""On the PYTHONPATH of a train command a test starts with KORA_TEST_MEGATRON_CPU=1
(tests/e2e/test_train_model_parallel_cpu.py): Python imports this at the start of every process of the run (the
driver, Ray's workers, the engines); where the trainer's backend choice is imported, megatron-core then runs on the
CPU (tests/megatron_cpu.py `install_in_trainer`: a test double for CUDA, which cannot run here)."""

import os
import sys
from pathlib import Path

if os.environ.get("KORA_TEST_MEGATRON_CPU") == "1":
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/: megatron_cpu
    import megatron_cpu

    megatron_cpu.install_in_trainer()
