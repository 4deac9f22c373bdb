# syntax=docker/dockerfile:1.7
# Two images from one build (no Docker engine runs on our dev machines: images are built in CI):
#   docker build --target operator -t ghcr.io/kora-dev/kora-operator:0.1.0 .
#   docker build --target trainer  -t ghcr.io/kora-dev/kora-trainer:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# The SGLang build the trainer image carries (rollout.sglangBuild; docs/sglang_builds.md tables their routes):
#   docker build --target trainer --build-arg SGLANG_BUILD=sglang-miles-94949da7 -t ...kora-trainer:0.1.0-miles .
# The trainer refuses at start a job naming another build than the one installed (sglang_build_problem).
ARG SGLANG_BUILD=0.5.23
# Each build's base image. UNVERIFIED: neither tag was pulled from here (no registry access) and so neither is
# pinned by digest yet: check each exists, then pin it (@sha256:...) — the issue asks for a digest per build.
# 0.5.23: lmsysorg/sglang's v<version>-cu<cuda> naming. sglang-miles: miles' own recipe (radixark/miles
# docker/Dockerfile @ 01719e81: FROM lmsysorg/sglang:v0.5.19, then the sglang-miles checkout installed over it).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu129
ARG SGLANG_MILES_IMAGE=lmsysorg/sglang:v0.5.19

# --- wheel: one build of the kora distribution for both images -----------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
COPY engine ./engine
COPY cli ./cli
RUN python -m build --wheel --outdir /dist

# --- operator: slim, non-root, no ML stack (import-linter keeps torch/ray out of kora_operator) ---
FROM ${PYTHON_IMAGE} AS operator
ARG KORA_VERSION=0.1.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=wheel /dist/kora-${KORA_VERSION}-py3-none-any.whl /tmp/
RUN pip install --no-cache-dir "/tmp/kora-${KORA_VERSION}-py3-none-any.whl[operator]" \
    && rm /tmp/kora-${KORA_VERSION}-py3-none-any.whl
# a numeric user (65532, "nonroot" by convention) so runAsNonRoot can verify it without /etc/passwd
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["kora"]
CMD ["operator"]

# --- the SGLang of each build: a stage per rollout.sglangBuild value ----------------------------------
FROM ${SGLANG_IMAGE} AS sglang-0.5.23

FROM ${SGLANG_MILES_IMAGE} AS sglang-sglang-miles-94949da7
# sgl-project/sglang's sglang-miles branch at the commit kora read its routes from (config/sglang_builds.py);
# the base image holds a git checkout of sglang in /sgl-workspace/sglang (miles installs over it the same way)
ARG SGLANG_MILES_COMMIT=94949da735cc04bf20b542d18bafff06d3f1b49f
WORKDIR /sgl-workspace/sglang
RUN git fetch origin sglang-miles && git checkout -f "${SGLANG_MILES_COMMIT}" \
    && SGLANG_BUILD_RUST_EXTS=none pip install --no-cache-dir --no-deps -e "python[all]"

# --- trainer: the named SGLang build + megatron-core + kora[trainer] (+ diffusion: a diffusion job runs in it) ---
# hadolint ignore=DL3006
FROM sglang-${SGLANG_BUILD} AS trainer
ARG SGLANG_BUILD
ARG KORA_VERSION=0.1.0
ARG MEGATRON_CORE_VERSION=0.12.2
ENV PYTHONUNBUFFERED=1
COPY --from=wheel /dist/kora-${KORA_VERSION}-py3-none-any.whl /tmp/
# torch and sglang come with the base image; pip keeps them when they satisfy kora's ranges
RUN pip install --no-cache-dir "megatron-core==${MEGATRON_CORE_VERSION}" \
        "/tmp/kora-${KORA_VERSION}-py3-none-any.whl[trainer,wandb,diffusion]" \
    && rm /tmp/kora-${KORA_VERSION}-py3-none-any.whl
# the image must hold the build it is named for (the trainer checks the same at start); SGLANG_CHECK=false only
# for a CPU image without SGLang (hack/e2e_kind.py: its toy runs kora's reference engine, rollout.engine hf)
ARG SGLANG_CHECK=true
RUN [ "${SGLANG_CHECK}" = "false" ] || python -c "import sys; from kora_trainer.config.sglang_builds import BUILDS; \
from kora_trainer.config.sections import SGLangBuild; \
from kora_trainer.orchestration.sglang_launcher import sglang_build_problem as p; \
sys.exit(p(BUILDS[SGLangBuild('${SGLANG_BUILD}')]))"
LABEL dev.kora.sglang-build="${SGLANG_BUILD}"
# Ray's dashboard probes the cloud metadata servers unless ~/ray_bootstrap_config.yaml exists, whatever
# RAY_USAGE_STATS_ENABLED says (kora_trainer/config/ray_env.py): kora's pods get a HOME that holds one
ENV HOME=/home/kora
RUN python -c "from kora_trainer.config.ray_env import IMAGE_RAY_HOME, ray_home; ray_home(IMAGE_RAY_HOME)" \
    && chmod -R a+rwX /home/kora
WORKDIR /workspace
# RayJob pods run `ray start`, then the driver `python -m kora_trainer.train --config /etc/kora/job.yaml`
EXPOSE 8068
