"""The environment every Ray process kora starts gets, so that none talks past loopback unasked.

One source for the trainer's private head (`orchestration/cluster.start_ray`), the `ray start` heads of
hack/ and the tests (`hack/localray.py`), and the pods and submissions the operator builds. Imports
nothing heavy: the operator reads it too. Each setting answers one Ray 2.60 behaviour, named with its file:

- `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (ray/_private/ray_constants.py `ENABLE_RAY_CLUSTER`, read once when
  Ray is imported): with it `services.get_node_ip_address` answers 127.0.0.1 instead of asking the kernel
  which address routes to 8.8.8.8 (a UDP connect), and a head started on 127.0.0.1 advertises 127.0.0.1,
  not the machine's own address. Single-node only: Ray then refuses a second node, so pods never get it.
- `RAY_USAGE_STATS_ENABLED=0` (ray/_common/usage/usage_lib.py `_usage_stats_enabledness`): no usage report.
- `RAY_USAGE_STATS_REPORT_URL=` (usage_lib `_usage_stats_report_url`; dashboard/modules/usage_stats/
  usage_stats_head.py `_report_disabled_usage_sync`): a `ray start` head with usage stats off still POSTs a
  "disabled" notice to this URL; an empty one fails in `requests` before any socket is opened.
- `~/ray_bootstrap_config.yaml` (usage_stats_head.py `run` -> usage_lib `get_cluster_config_to_report`):
  when the file is absent the dashboard probes the Azure, GCP and AWS metadata servers (169.254.169.254,
  metadata.google.internal, so DNS too) BEFORE it looks at whether usage stats are on. The file is the
  cluster config Ray's own cluster launcher leaves on every head it starts; with one present (provider
  `local`) nothing is probed. Ray finds it through HOME, so kora gives its Ray processes a HOME that holds
  one (`ray_home`), never writing into the user's own.
"""

from __future__ import annotations

from pathlib import Path

BOOTSTRAP_FILE = "ray_bootstrap_config.yaml"
BOOTSTRAP_TEXT = ("# written by kora: a cluster config, so Ray's usage module does not probe cloud metadata\n"
                  "provider:\n  type: local\n")
# in the trainer image (Dockerfile): the HOME of kora's pods, holding BOOTSTRAP_FILE
IMAGE_RAY_HOME = "/home/kora"


def usage_stats_env(enabled: bool = False) -> dict[str, str]:
    """Ray usage statistics off (the default) or, opted in, on as Ray ships them."""
    if enabled:
        return {"RAY_USAGE_STATS_ENABLED": "1"}
    return {"RAY_USAGE_STATS_ENABLED": "0", "RAY_USAGE_STATS_REPORT_URL": ""}


def single_node_env() -> dict[str, str]:
    """A one-node Ray on 127.0.0.1 (the trainer's private head, hack/localray.py): loopback only, no probe."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **usage_stats_env(False)}


def multi_node_env() -> dict[str, str]:
    """A Ray node of a cluster of several (hack/netns_cluster.py's namespaced nodes): no usage report, no probe.

    - `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1` (ray_constants.py `ENABLE_RAY_CLUSTER`): without it `ray start
      --address=...` aborts ("Multi-node Ray clusters are not supported", scripts.py `start`), and every process
      that asks `services.get_node_ip_address` before it has a node gets 127.0.0.1, which another node cannot
      reach. With it Ray asks the kernel which source address routes toward 8.8.8.8:53 (a UDP connect, no
      packet: `node_ip_address_from_perspective`, then its IPv6 twin 2001:4860:4860::8888). `ray start` asks
      even when given `--node-ip-address` (scripts.py evaluates `update_if_absent`'s argument eagerly), and so
      does each node's runtime-env agent; so a node runs where that connect cannot get out (in a network
      namespace without a default route it fails with ENETUNREACH) and is given its address.
    - usage statistics off, as `usage_stats_env(False)` says.
    """
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", **usage_stats_env(False)}


def ray_home(directory: str | Path) -> Path:
    """Make `directory` a HOME for Ray processes: it holds the bootstrap config that stops the metadata probe."""
    home = Path(directory)
    home.mkdir(parents=True, exist_ok=True)
    (home / BOOTSTRAP_FILE).write_text(BOOTSTRAP_TEXT)
    return home
