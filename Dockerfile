# syntax=docker/dockerfile:1
# llmctl: `llmctl serve` (default) or `llmctl router` in one image. See docs/deploy.md.
#
#   CPU (default):  docker build -t llmctl:0.1.0-cpu .
#   CUDA:           docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t llmctl:0.1.0-cuda .
#                   (torch's CUDA wheels bring their CUDA libraries; the node's driver comes from the
#                   NVIDIA container toolkit, so the base image stays the same)
#   Run:            docker run -p 8000:8000 -v llmctl-cache:/cache -e LLMCTL_MODEL=Qwen/Qwen2.5-0.5B-Instruct llmctl:0.1.0-cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# checkov:skip=CKV_DOCKER_7: the base image is the ARG above, whose default is a versioned tag
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG LLMCTL_UID=10001

# DL3064 reads TOKENIZERS_PARALLELISM as a secret ("TOKEN"); it is a switch of the tokenizers library
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/llmctl/venv \
    PATH=/opt/llmctl/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    LLMCTL_KERNEL_CACHE=/opt/llmctl/kernels \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_DISABLE_TELEMETRY=1

# g++ stays in the image: the native CPU kernels are built at image build time (one portable build
# with per-ISA variants chosen at run time, so any x86-64 node uses it), but a changed toolchain or
# torch rebuilds them once at start-up; Triton compiles its CUDA launcher with it too. Debian's
# versions are not pinned: bookworm's security updates replace them, and an old pin would no
# longer install.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid "${LLMCTL_UID}" llmctl \
    && useradd --uid "${LLMCTL_UID}" --gid "${LLMCTL_UID}" --create-home --shell /usr/sbin/nologin llmctl \
    && mkdir -p /cache /opt/llmctl/src \
    && chown -R llmctl:llmctl /cache /opt/llmctl

USER ${LLMCTL_UID}:${LLMCTL_UID}
WORKDIR /opt/llmctl/src

# torch first and pinned, from the index that picks CPU or CUDA, so the second install keeps it
RUN python -m venv "${VIRTUAL_ENV}" \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY --chown=llmctl:llmctl pyproject.toml README.md ./
COPY --chown=llmctl:llmctl llmctl ./llmctl
COPY --chown=llmctl:llmctl kernels ./kernels
RUN pip install . \
    && python -m llmctl_kernels.cpu_native

COPY --chmod=755 deploy/docker/entrypoint.sh /usr/local/bin/llmctl-entrypoint
COPY --chmod=755 deploy/docker/healthcheck.py /usr/local/bin/llmctl-healthcheck

# the Hugging Face cache (models) and Triton's cache: mount a volume here
VOLUME ["/cache"]
EXPOSE 8000 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["llmctl-healthcheck"]
ENTRYPOINT ["llmctl-entrypoint"]
CMD ["serve"]
