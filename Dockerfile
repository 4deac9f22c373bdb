# syntax=docker/dockerfile:1.7
# Two images from one build (no Docker engine runs on our dev machines: images are built in CI):
#   docker build --target operator -t ghcr.io/kora-dev/kora-operator:0.1.0 .
#   docker build --target trainer  -t ghcr.io/kora-dev/kora-trainer:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# SGLang's LoRA routes change between releases (SPEC: match sglang 0.5.23 exactly), so the base is
# pinned. UNVERIFIED: this tag follows lmsysorg/sglang's v<version>-cu<cuda> naming but was not
# pulled from here (no registry access); check it exists, then pin its digest (@sha256:...).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu129

# --- wheel: one build of the kora distribution for both images -----------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY trainer ./trainer
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

# --- trainer: the pinned SGLang image + megatron-core + kora[trainer] ------------------------------
FROM ${SGLANG_IMAGE} AS trainer
ARG KORA_VERSION=0.1.0
ARG MEGATRON_CORE_VERSION=0.12.2
ENV PYTHONUNBUFFERED=1
COPY --from=wheel /dist/kora-${KORA_VERSION}-py3-none-any.whl /tmp/
# torch and sglang come with the base image; pip keeps them when they satisfy kora's ranges
RUN pip install --no-cache-dir "megatron-core==${MEGATRON_CORE_VERSION}" \
        "/tmp/kora-${KORA_VERSION}-py3-none-any.whl[trainer,wandb]" \
    && rm /tmp/kora-${KORA_VERSION}-py3-none-any.whl
# Ray's dashboard probes the cloud metadata servers unless ~/ray_bootstrap_config.yaml exists, whatever
# RAY_USAGE_STATS_ENABLED says (kora_trainer/config/ray_env.py): kora's pods get a HOME that holds one
ENV HOME=/home/kora
RUN python -c "from kora_trainer.config.ray_env import IMAGE_RAY_HOME, ray_home; ray_home(IMAGE_RAY_HOME)" \
    && chmod -R a+rwX /home/kora
WORKDIR /workspace
# RayJob pods run `ray start`, then the driver `python -m kora_trainer.train --config /etc/kora/job.yaml`
EXPOSE 8068
