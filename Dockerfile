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
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_DISABLE_TELEMETRY=1

# g++: the native CPU kernels compile at image build time (`pip install`, setup.py: one portable
# build with per-ISA variants chosen at run time, so any x86-64 node uses it); it stays in the
# image because Triton compiles its CUDA launcher with it. Debian's
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
# (and builds the native kernels against it: --no-build-isolation, with setuptools and ninja here)
RUN python -m venv "${VIRTUAL_ENV}" \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install "setuptools>=77" "ninja>=1.11"

COPY --chown=llmctl:llmctl pyproject.toml setup.py README.md ./
COPY --chown=llmctl:llmctl llmctl ./llmctl
COPY --chown=llmctl:llmctl kernels ./kernels
RUN pip install --no-build-isolation . \
    && python -m llmctl_kernels.cpu_native

COPY --chmod=755 deploy/docker/entrypoint.sh /usr/local/bin/llmctl-entrypoint
COPY --chmod=755 deploy/docker/healthcheck.py /usr/local/bin/llmctl-healthcheck

# the Hugging Face cache (models) and Triton's cache: mount a volume here
VOLUME ["/cache"]
EXPOSE 8000 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["llmctl-healthcheck"]
ENTRYPOINT ["llmctl-entrypoint"]
CMD ["serve"]
