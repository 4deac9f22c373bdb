"""The control-plane token under the chart's least-privilege RBAC: the operator, running with the
chart's service account (scope Namespace), makes its key Secret, may read that one Secret and no
other, and the job's Secret holds HMAC(key, uid) — the token it will poll the trainer with."""

from __future__ import annotations

import base64
import subprocess
import uuid
from pathlib import Path

import yaml

from kora_operator.tokens import derive_token
from localcluster import wait_for
from operatorkit import Operator, apply, children, forbidden_in, install_crds
from specs import valid_job

ROOT = Path(__file__).resolve().parents[2]
LOGS = Path("/tmp/kora-logs")


def can_i(cluster, sa, verb, what, ns) -> bool:
    return cluster.kubectl("auth", "can-i", verb, what, "-n", ns, f"--as={sa}", check=False).stdout.strip() == "yes"


def test_the_operator_key_lives_in_one_secret_it_alone_may_read(cluster, tmp_path):
    install_crds(cluster)
    ns, release = f"tok-{uuid.uuid4().hex[:6]}", "kora-tk"
    cluster.kubectl("create", "namespace", ns)
    try:
        rendered = subprocess.run(
            [str(cluster.bin_dir / "helm"), "template", release, str(ROOT / "charts/kora"), "--namespace", ns,
             "--set", "scope=Namespace"], capture_output=True, text=True, timeout=120, check=True).stdout
        rbac = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(rbac))
        (dep,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"]
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--key-secret={ns}/{release}-key" in args
        sa = f"system:serviceaccount:{ns}:{release}"
        assert can_i(cluster, sa, "get", f"secret/{release}-key", ns)
        assert not can_i(cluster, sa, "get", "secrets", ns) and not can_i(cluster, sa, "list", "secrets", ns)
        assert not can_i(cluster, sa, "get", "secret/job-control-token", ns)

        token = cluster.kubectl("create", "token", release, "-n", ns, "--duration=1h").stdout.strip()
        kubeconfig = yaml.safe_load(cluster.kubeconfig.read_text())
        kubeconfig["users"] = [{"name": "sa", "user": {"token": token}}]
        kubeconfig["contexts"][0]["context"]["user"] = "sa"
        path = tmp_path / "sa.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        log = LOGS / f"operator-{ns}.log"
        op = Operator(cluster, [ns], log, kubeconfig=path, env={"KORA_OPERATOR_KEY": ""},
                      args=[f"--key-secret={ns}/{release}-key"]).start()
        try:
            apply(cluster, valid_job("tokened"), ns)
            secret = wait_for(lambda: [s for s in children(cluster, "tokened", ns)["Secret"] if "token" in s["data"]],
                              timeout=30, what="the job's token Secret")
        finally:
            op.stop()
        key_secret = yaml.safe_load(cluster.kubectl("get", "secret", f"{release}-key", "-n", ns, "-o", "yaml").stdout)
        key = base64.b64decode(key_secret["data"]["key"])
        uid = yaml.safe_load(cluster.kubectl("get", "ltj", "tokened", "-n", ns, "-o", "yaml").stdout)["metadata"]["uid"]
        assert base64.b64decode(secret[0]["data"]["token"]).decode() == derive_token(key.strip(), uid)
        text = log.read_text()
        assert f"derived from the operator key in Secret {ns}/{release}-key" in text
        assert not forbidden_in(text)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
