# kora developer targets. `make test` is the one command a newcomer needs (see README).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kora-installed

.PHONY: images chaos demo demo-multi multi-lora-curves bench-multi-lora nettrace setup test test-full test-unit e2e-kind e2e-node lint manifests manifests-check testbin cluster-up node-up cluster-down clean

# constraints.txt: the pinned versions, the same the images install (tests/unit/test_pins.py holds them together)
$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade -c constraints.txt pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[operator,trainer,wandb,diffusion]' --group dev
	touch $(STAMP)

setup: $(STAMP)  ## venv with kora[operator,trainer,wandb,diffusion] and the test/lint tools (and strace + iproute2, for the loopback and two-node tests; containerd, runc, CNI plugins, iptables, gcc for the real node; buildah, podman, debootstrap for the images)
	@bash hack/install_tools.sh

testbin:  ## build (once) or find the pinned etcd/kube-apiserver/kubectl/helm/KubeRay binaries
	bash hack/testbin.sh

demo: setup testbin  ## control plane + Ray + operator on 127.0.0.1; train the toy job; describe it; clean up
	$(PY) hack/demo.py

test: setup testbin  ## unit + integration tests against a real local control plane
	$(PY) -m pytest

test-full: setup testbin  ## every case, the `full`-marked ones too (more modes, builds and sizes than CI runs)
	$(PY) -m pytest -m ""

test-unit: setup
	$(PY) -m pytest tests/unit

demo-multi: setup testbin  ## a multi-adapter service: LoRAAdapters applied, added and deleted with kubectl; kubectl get lad
	$(PY) hack/demo_multi.py

multi-lora-curves: setup  ## two adapters on the toy at once for 8 minutes: both reward curves (bench/multi_lora.py --curves)
	$(PY) bench/multi_lora.py --curves --out bench/results/multi_lora_curves_cpu_$$(date +%F).json

bench-multi-lora: setup  ## multi-LoRA sync bytes/ms and generation throughput at 1, 2 and 4 adapters, as ratios to 1
	$(PY) bench/multi_lora.py --out bench/results/multi_lora_scaling_cpu_$$(date +%F).json

chaos: setup testbin  ## faults on purpose (issue 18 item 1), full size: one script per part, each writing bench/results/chaos_*.json
	$(PY) bench/chaos_operator.py
	$(PY) bench/chaos_trainer.py

nettrace: setup testbin  ## `make demo` under strace: every network destination its processes reached (hack/nettrace.py)
	$(PY) hack/nettrace.py -- $(PY) hack/demo.py --steps 40

images: setup  ## the operator and CPU trainer images from the Dockerfile, with buildah (root; no Docker): .kora/images/*.tar
	$(PY) hack/images.py

e2e-node: setup testbin  ## our images on a real node of ours: helm install charts/kora, KubeRay as a pod, the toy job to Succeeded (root; hack/e2e_node.py)
	$(PY) hack/e2e_node.py

e2e-kind: setup  ## kind + KubeRay (Helm) + our images + charts/kora; the toy job to Succeeded. Skips without Docker/kind
	$(PY) hack/e2e_kind.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy operator/kora_operator cli/kora_cli trainer/kora_trainer engine/kora_engine
	$(VENV)/bin/lint-imports
	@if [ -f Dockerfile ]; then $(VENV)/bin/hadolint Dockerfile; fi

manifests: setup  ## regenerate CRDs from the pydantic models, and manifests/install.yaml from the chart
	$(PY) -m kora_operator.api.crd
	$$(bash hack/testbin.sh | tail -n 1)/helm template kora charts/kora --namespace kora-system --include-crds \
		> manifests/install.yaml

manifests-check: setup
	$(PY) -m kora_operator.api.crd --check

cluster-up: setup testbin  ## etcd + kube-apiserver + kube-controller-manager on 127.0.0.1
	$(PY) hack/localcluster.py up

node-up: setup testbin  ## cluster-up plus a real node: containerd, kubelet, kube-proxy, scheduler, CoreDNS (root; hack/node/README.md)
	$(PY) hack/localcluster.py up --node

cluster-down:  ## stops the cluster (and its node: bridge, iptables chains, mounts, cgroups removed)
	$(PY) hack/localcluster.py down

clean: cluster-down
	rm -rf .kora $(VENV)
