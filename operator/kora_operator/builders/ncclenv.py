"""The NCCL / gloo environment of a job's Ray processes: the pods of its RayJob, or its runtime-Ray submission.

The trainer's ranks, its engines and the weight-update group talk over NCCL on GPU and gloo on CPU, across
Ray's nodes (KubeRay worker pods). NCCL_ENV is kora's small default set, each variable with its reason;
`spec.runtime.env` overrides any of them (and adds others, e.g. NCCL_IB_HCA for an InfiniBand fabric).
"""

from __future__ import annotations

from kora_operator.api.job import LoRATrainingJob

NCCL_ENV: dict[str, str] = {
    # NCCL's bootstrap and socket transport on the pod's own interface: eth0 in every pod on the pod network (the
    # name the container runtime gives a pod's CNI interface), whose address Ray advertises and every other pod
    # reaches. Left to itself NCCL prefers any ib* / secondary (Multus) interface, which need not route between
    # pods, and the group hangs at init. Data still goes over InfiniBand/RoCE where NCCL finds it: this names the
    # socket interface only.
    "NCCL_SOCKET_IFNAME": "eth0",
    # gloo (the CPU weight-update group, megatron-core's CPU groups) on the same interface: torch's gloo binds
    # to the address the hostname resolves to, and falls back to 127.0.0.1 ("Unable to resolve hostname to a
    # (local) address") where that fails, which no other pod can reach. gloo takes one concrete name.
    "GLOO_SOCKET_IFNAME": "eth0",
    # No NVLink SHARP (NVLS): setting up its multicast memory needs the NVSwitch fabric manager (and IMEX across
    # nodes), which GPU containers often lack; there the communicator fails ("Failed to bind NVLink SHARP
    # (NVLS) Multicast memory: CUDA error 401") or hangs at init, and NVLS reserves GPU memory per communicator.
    # kora's weight-update group broadcasts, which NVLS does not speed up. runtime.env NCCL_NVLS_ENABLE=1 turns
    # it back on where the fabric supports it.
    "NCCL_NVLS_ENABLE": "0",
    # A failing communicator says why in the Ray workers' logs (NCCL is silent by default); no INFO chatter.
    "NCCL_DEBUG": "WARN",
    # Not set: TORCH_NCCL_ASYNC_ERROR_HANDLING. torch >= 2.2 defaults to 3 (a timed-out collective tears the
    # process down, so Ray sees the failure); the 1 of older recipes also aborts the communicator first, which can
    # hang. TORCH_NCCL_BLOCKING_WAIT neither: it makes every collective wait on the CPU.
}

# Pinned to the pod network's interface name: right for the pods kora builds, wrong for an existing Ray
# cluster's machines (ens5, bond0, ... or a loopback-only local head, whose trainer must not bind to the
# machine's own address), so a runtime-Ray submission leaves them to that cluster.
POD_INTERFACE = frozenset({"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"})


def nccl_env(job: LoRATrainingJob, pod: bool) -> dict[str, str]:
    """NCCL_ENV for a pod kora builds (`pod`) or a submission to an existing cluster, under spec.runtime.env."""
    base = {k: v for k, v in NCCL_ENV.items() if pod or k not in POD_INTERFACE}
    return base | dict(job.spec.runtime.env)
