# syntax=docker/dockerfile:1.7
# kora's images, all from this one file:
#   operator     slim, non-root (65532), no ML stack
#   trainer-cpu  torch backend + kora's reference engine, no SGLang: the trainer of a kind or CPU cluster
#   trainer      the GPU trainer: the SGLang build the job names + megatron-core (FROM an SGLang image)
# Here (no Docker engine, no registry): `make images` (hack/images.py) builds operator and trainer-cpu with buildah and
# writes OCI archives under .kora/images/. With a registry and Docker (BuildKit):
#   docker build --secret id=ca,src=<CA bundle, only behind a TLS proxy> --target operator -t ghcr.io/kora-dev/kora-operator:0.1.0 .
#   docker build --target trainer-cpu -t ghcr.io/kora-dev/kora-trainer:0.1.0-cpu .
#   docker build --target trainer     -t ghcr.io/kora-dev/kora-trainer:0.1.0 .
#
# BASE_IMAGE: a bare Debian bookworm; every stage below installs Debian's python3.11 (+ venv) into it with apt, so the
# images are the same whichever base is used. A registry-connected build uses debian:bookworm-slim (the default; pin it
# by digest where a registry is reachable). hack/images.py builds FROM localhost/kora-base:bookworm-<hash>, made here
# by `debootstrap --variant=minbase bookworm` (what debian:bookworm-slim is made from), so no image is pulled. The
# image test (tests/e2e/test_images.py) checks the same things of either: `KORA_BASE_IMAGE=debian:bookworm-slim
# make images` builds on the registry's base.
ARG BASE_IMAGE=debian:bookworm-slim
# The SGLang build the GPU trainer image carries (rollout.sglangBuild; docs/sglang_builds.md tables their routes):
#   docker build --target trainer --build-arg SGLANG_BUILD=sglang-miles-94949da7 -t ...kora-trainer:0.1.0-miles .
# The trainer refuses at start a job naming another build than the one installed (sglang_build_problem).
ARG SGLANG_BUILD=0.5.23
# Each build's base image. UNVERIFIED: neither tag was pulled from here (no registry access) and so neither is
# pinned by digest yet: check each exists, then pin it (@sha256:...) — the issue asks for a digest per build.
# 0.5.23: lmsysorg/sglang's v<version>-cu<cuda> naming. sglang-miles: miles' own recipe (radixark/miles
# docker/Dockerfile @ 01719e81: FROM lmsysorg/sglang:v0.5.19, then the sglang-miles checkout installed over it).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu129
ARG SGLANG_MILES_IMAGE=lmsysorg/sglang:v0.5.19
# 0.5.17: the build kora has run on a GPU (torch 2.11, as the device machine has; docs/sglang_builds.md "Run for real")
ARG SGLANG_0_5_17_IMAGE=lmsysorg/sglang:v0.5.17

# Versions: constraints.txt is the one source of truth (the tests' venv installs it too; tests/unit/test_pins.py
# fails when a version is named anywhere else). pip reads it through PIP_CONSTRAINT in every stage.
# pip inside a build behind a TLS-intercepting proxy: hand the build the machine's CA bundle as the secret `ca`; each
# pip RUN points PIP_CERT at it for that command only (a secret is never in a layer). pip's downloads live in a cache
# mount (id kora-pip), never in a layer, so a rebuild after a pin moves downloads nothing it already has.

# --- python: Debian's python3.11 in a venv (/opt/kora), pip at the pinned version ----------------------------
FROM ${BASE_IMAGE} AS python
ARG DEBIAN_FRONTEND=noninteractive
# Debian's archive holds only the current stable version of each package (a version pin breaks at the next point
# release); the suite (bookworm) is the pin
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/kora
ENV VIRTUAL_ENV=/opt/kora PATH=/opt/kora/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    PIP_CONSTRAINT=/opt/kora/constraints.txt
COPY constraints.txt /opt/kora/constraints.txt
# pip's versions: PIP_CONSTRAINT (constraints.txt), never written here; its cache is a cache mount, never in a layer
# hadolint ignore=DL3013,DL3042
RUN --mount=type=cache,id=kora-pip,target=/root/.cache/pip,sharing=locked --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install --upgrade pip

# --- reqs: kora's dependencies as pyproject lists them, so they install before kora's code is copied ----------
# (a pyproject edit that leaves them as they were yields the same files: the layers after them stay cached)
FROM python AS reqs
COPY pyproject.toml /src/pyproject.toml
RUN mkdir /reqs && python -c "import tomllib; \
p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; \
w = lambda name, deps: open(f'/reqs/{name}.txt', 'w').write(''.join(d + '\n' for d in deps)); \
w('operator', p['dependencies'] + x['operator']); \
w('trainer', p['dependencies'] + x['trainer'] + x['wandb'] + x['diffusion'])"

# --- wheel: one build of the kora distribution for every image ------------------------------------------------
FROM python AS wheel
# hadolint ignore=DL3013,DL3042
RUN --mount=type=cache,id=kora-pip,target=/root/.cache/pip,sharing=locked --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install hatchling
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
COPY engine ./engine
COPY cli ./cli
RUN pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /dist /src

# --- operator: slim, non-root, no ML stack (import-linter keeps torch/ray out of kora_operator) ---------------
FROM python AS operator
COPY --from=reqs /reqs/operator.txt /tmp/requirements.txt
# hadolint ignore=DL3042
RUN --mount=type=cache,id=kora-pip,target=/root/.cache/pip,sharing=locked --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install -r /tmp/requirements.txt
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps --no-index /tmp/dist/kora-*.whl && rm -rf /tmp/dist /tmp/requirements.txt
ENV PYTHONDONTWRITEBYTECODE=1
# a numeric user (65532, "nonroot" by convention) so runAsNonRoot can verify it without /etc/passwd
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["kora"]
CMD ["operator"]

# --- trainer-cpu: kora[trainer,wandb,diffusion] on PyPI's torch (its CUDA build; the CPU tests run the same) --
FROM python AS trainer-cpu
ARG DEBIAN_FRONTEND=noninteractive
# KubeRay's head and worker probes run wget in the Ray container
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
COPY --from=reqs /reqs/trainer.txt /tmp/requirements.txt
# hadolint ignore=DL3042
RUN --mount=type=cache,id=kora-pip,target=/root/.cache/pip,sharing=locked --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install -r /tmp/requirements.txt
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps --no-index /tmp/dist/kora-*.whl && rm -rf /tmp/dist /tmp/requirements.txt
# no SGLang here: a job runs kora's reference engine (rollout.engine hf), as the CPU tests do
LABEL dev.kora.sglang-build="none"
# Ray's dashboard probes the cloud metadata servers unless ~/ray_bootstrap_config.yaml exists, whatever
# RAY_USAGE_STATS_ENABLED says (kora_trainer/config/ray_env.py): kora's pods get a HOME that holds one
ENV HOME=/home/kora
RUN python -c "from kora_trainer.config.ray_env import IMAGE_RAY_HOME, ray_home; ray_home(IMAGE_RAY_HOME)" \
    && chmod -R a+rwX /home/kora
WORKDIR /workspace
# RayJob pods run `ray start`, then the driver `python -m kora_trainer.train --config /etc/kora/job.yaml`
EXPOSE 8068

# --- the SGLang of each build: a stage per rollout.sglangBuild value ----------------------------------------
FROM ${SGLANG_IMAGE} AS sglang-0.5.23

FROM ${SGLANG_0_5_17_IMAGE} AS sglang-0.5.17

FROM ${SGLANG_MILES_IMAGE} AS sglang-sglang-miles-94949da7
# sgl-project/sglang's sglang-miles branch at the commit kora read its routes from (config/sglang_builds.py);
# the base image holds a git checkout of sglang in /sgl-workspace/sglang (miles installs over it the same way)
ARG SGLANG_MILES_COMMIT=94949da735cc04bf20b542d18bafff06d3f1b49f
WORKDIR /sgl-workspace/sglang
RUN git fetch origin sglang-miles && git checkout -f "${SGLANG_MILES_COMMIT}" \
    && SGLANG_BUILD_RUST_EXTS=none pip install --no-cache-dir --no-deps -e "python[all]"

# --- trainer: the named SGLang build + megatron-core + kora[trainer,wandb,diffusion] (GPU) -------------------
# hadolint ignore=DL3006
FROM sglang-${SGLANG_BUILD} AS trainer
ARG SGLANG_BUILD
ENV PYTHONUNBUFFERED=1
COPY constraints.txt /tmp/constraints.txt
COPY --from=wheel /dist/ /tmp/dist/
# every pin but those of the packages the SGLang image brings itself (tagged `sglang-image` in constraints.txt: its
# kernels are built against them); megatron-core's pin is the Python >= 3.12 one, the version the GPU tests ran
# hadolint ignore=DL3013
RUN grep -v '# sglang-image' /tmp/constraints.txt > /tmp/kora-constraints.txt \
    && PIP_CONSTRAINT=/tmp/kora-constraints.txt pip install --no-cache-dir megatron-core \
        "$(ls /tmp/dist/kora-*.whl)[trainer,wandb,diffusion]" \
    && rm -rf /tmp/dist /tmp/constraints.txt /tmp/kora-constraints.txt
# the image must hold the build it is named for (the trainer checks the same at start)
RUN python -c "import sys; from kora_trainer.config.sglang_builds import BUILDS; \
from kora_trainer.config.sections import SGLangBuild; \
from kora_trainer.orchestration.sglang_launcher import sglang_build_problem as p; \
sys.exit(p(BUILDS[SGLangBuild('${SGLANG_BUILD}')]))"
LABEL dev.kora.sglang-build="${SGLANG_BUILD}"
ENV HOME=/home/kora
RUN python -c "from kora_trainer.config.ray_env import IMAGE_RAY_HOME, ray_home; ray_home(IMAGE_RAY_HOME)" \
    && chmod -R a+rwX /home/kora
WORKDIR /workspace
EXPOSE 8068
