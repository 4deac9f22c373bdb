"""Which address a job's services bind: 127.0.0.1 while the Ray cluster is one node (nothing need leave the
machine), the node's Ray address once it spans nodes (engines, the weight-update group and the trainer's
process group must then be reached from the other nodes)."""

from __future__ import annotations


def spans_nodes() -> bool:
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    return sum(1 for n in ray.nodes() if n.get("Alive")) > 1


def node_address() -> str:
    """This process's node address for services other nodes must reach; 127.0.0.1 on a one-node cluster."""
    import ray  # noqa: PLC0415 - Ray loads when a job runs, not on import

    return ray.util.get_node_ip_address() if spans_nodes() else "127.0.0.1"
