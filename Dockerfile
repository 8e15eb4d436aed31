# gpu-topology-agent container image.
#
#   docker build -t gpu-topology-agent:0.1.0 .
#
# Two stages: the builder has the compiler and builds our wheel (the Cython engine
# agent._topo and the kubelet gRPC stubs are generated during that build) and installs it
# with its dependencies into /opt/venv; the runtime stage is the same slim Python image plus
# that virtual environment and nothing else. No NVIDIA library is baked in: the NVIDIA
# container toolkit mounts the host driver's libnvidia-ml.so into the container, driven by
# the two NVIDIA_* variables below.

# Both stages use the same base image, so the compiled extension matches the runtime's
# Python ABI and the venv's interpreter symlinks resolve.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Only what the build reads: packaging metadata (pyproject names README.md as the readme,
# MANIFEST.in lists the package's files), the build script, the Cython source, the .proto
# files, the package.
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY ext/ ext/
COPY proto/ proto/
COPY agent/ agent/
# pip wheel builds our wheel in an isolated environment with the build requirements
# (setuptools, Cython, grpcio-tools at its pinned version) and fetches wheels for the
# dependencies; the install then uses only those wheels.
RUN python -m venv /opt/venv \
 && pip wheel --no-cache-dir --wheel-dir /wheels . \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels gpu-topology-agent \
 && /opt/venv/bin/python -c "import agent._topo, agent._proto.deviceplugin_v1beta1_pb2_grpc, agent._proto.podresources_v1_pb2_grpc"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpu-topology-agent" \
      org.opencontainers.image.description="Kubernetes GPU node agent: device plugin, feature labels and DCGM-compatible metrics, topology-aware" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# Non-root by default, so `docker run gpu-topology-agent:0.1.0 demo` (or discover) runs
# unprivileged. The DaemonSet overrides this with runAsUser: 0 because the kubelet's
# device-plugin directory and sockets are root-owned on most nodes; it drops every
# capability instead (see daemonset/base/daemonset.yaml).
RUN useradd --system --uid 10001 --user-group --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin agent
USER 10001:10001
# 9400: /metrics (TLS and basic auth with --web-config-file); 9401: /health and /ready
EXPOSE 9400 9401
ENTRYPOINT ["gpu-topology-agent"]
CMD ["run"]
