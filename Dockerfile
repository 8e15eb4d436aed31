# gpu-topology-agent container image.
#
#   docker build -t gpu-topology-agent:0.1.0 .
#
# Two stages: the builder has the compiler and builds our wheel (the Cython engine
# agent._topo and the kubelet gRPC stubs are generated during that build) and installs it
# with its dependencies into /opt/venv; the runtime stage is the same slim Python image plus
# that virtual environment, without pip, setuptools or wheel. No NVIDIA library is baked in:
# the NVIDIA container toolkit mounts the host driver's libnvidia-ml.so into the container,
# driven by the two NVIDIA_* variables below.

# Both stages use the same base image, so the compiled extension matches the runtime's
# Python ABI and the venv's interpreter symlinks resolve.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
# The venv gets no pip of its own: the base image's pip installs into it (--python), so
# nothing but the agent and its dependencies is copied into the runtime image.
RUN python -m venv --without-pip /opt/venv
WORKDIR /src

# 1. Dependencies, from pyproject.toml alone: this layer is rebuilt only when
#    pyproject.toml changes, not on every change to the source. Wheels of the runtime
#    dependencies and of the build requirements (setuptools, Cython, grpcio-tools at its
#    pinned version) go to /wheels; the runtime dependencies are installed into the venv.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
open('/tmp/runtime.txt', 'w').write('\n'.join(p['project']['dependencies'])); \
open('/tmp/build.txt', 'w').write('\n'.join(p['build-system']['requires']))" \
 && pip wheel --no-cache-dir --wheel-dir /wheels -r /tmp/runtime.txt -r /tmp/build.txt \
 && pip --python /opt/venv/bin/python install --no-cache-dir --no-index --find-links /wheels \
        -r /tmp/runtime.txt

# 2. Our package. Only what the build reads: packaging metadata (pyproject names README.md
#    as the readme, MANIFEST.in lists the package's files), the build script, the Cython
#    source, the .proto files, the package. The wheel is built offline from the wheels of
#    step 1 (build isolation included), installed without dependencies (step 1 has them;
#    `pip check` proves it), and imported from outside /src, where the source tree would
#    shadow the installed package and its compiled modules.
COPY setup.py MANIFEST.in README.md ./
COPY ext/ ext/
COPY proto/ proto/
COPY agent/ agent/
RUN pip wheel --no-cache-dir --no-index --find-links /wheels --no-deps --wheel-dir /dist . \
 && pip --python /opt/venv/bin/python install --no-cache-dir --no-index --no-deps /dist/*.whl \
 && pip --python /opt/venv/bin/python check \
 && cd / \
 && /opt/venv/bin/python -I -c "import agent._topo, agent._proto.deviceplugin_v1beta1_pb2_grpc, agent._proto.podresources_v1_pb2_grpc"

FROM ${PYTHON_IMAGE}
# Set at build time: --build-arg VERSION=... (the package version), REVISION=$(git rev-parse
# HEAD) and SOURCE=<the repository's URL>.
ARG VERSION=0.1.0
ARG REVISION=""
ARG SOURCE=""
LABEL org.opencontainers.image.title="gpu-topology-agent" \
      org.opencontainers.image.description="Kubernetes GPU node agent: device plugin, feature labels and DCGM-compatible metrics, topology-aware" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
# Non-root by default, so `docker run gpu-topology-agent:0.1.0 demo` (or discover) runs
# unprivileged: user and group 10001 both exist. The DaemonSet overrides this with
# runAsUser: 0 because the kubelet's device-plugin directory and sockets are root-owned on
# most nodes; it drops every capability instead (see daemonset/base/daemonset.yaml). The
# base image's pip, setuptools and wheel go: nothing at run time installs packages.
RUN groupadd --gid 10001 agent \
 && useradd --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin agent \
 && rm -rf /usr/local/bin/pip /usr/local/bin/pip3* /usr/local/bin/wheel \
        /usr/local/lib/python3*/site-packages/pip /usr/local/lib/python3*/site-packages/pip-* \
        /usr/local/lib/python3*/site-packages/setuptools /usr/local/lib/python3*/site-packages/setuptools-* \
        /usr/local/lib/python3*/site-packages/pkg_resources /usr/local/lib/python3*/site-packages/_distutils_hack \
        /usr/local/lib/python3*/site-packages/distutils-precedence.pth \
        /usr/local/lib/python3*/site-packages/wheel /usr/local/lib/python3*/site-packages/wheel-*
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
USER 10001:10001
# 9400: /metrics (TLS and basic auth with --web-config-file); 9401: /health and /ready
EXPOSE 9400 9401
ENTRYPOINT ["gpu-topology-agent"]
CMD ["run"]
