# pdserve: router and engines in one image; the command picks the role (see compose.yaml).
#
#   docker build -t pdserve .                                   # CUDA torch (PyPI's Linux wheel)
#   docker build -t pdserve:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                --build-arg SKIP_DEPS=triton .                 # CPU torch, no Triton: the small CPU image
#   docker run --rm -p 8000:8000 pdserve up --host 0.0.0.0      # demo model, 1 prefill + 1 decode, CPU
#
# BASE_IMAGE: any Debian-like image with python3 (>= 3.11) and its venv module; deploy/base_image.sh makes
# one offline with debootstrap where no registry can be pulled from. ./pip-local (git-ignored but for its
# README) feeds pip machine-local wheels and settings, e.g. a CPU torch wheel where PyTorch's index is out of reach.
# It runs as the unprivileged user `pdserve` (uid 10001). OMP_NUM_THREADS defaults to the container's
# cores (docker/entrypoint.sh); set it to override.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG SKIP_DEPS=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/pdserve \
    HF_HOME=/home/pdserve/.cache/huggingface \
    PDSERVE_CACHE=/home/pdserve/.cache/pdserve

# A non-root user owns the volumes' mount points, so fresh named volumes are created writable by it.
RUN useradd --create-home --uid 10001 --user-group pdserve \
 && mkdir -p /keys /demo "${HF_HOME}" "${PDSERVE_CACHE}" \
 && chown -R pdserve:pdserve /keys /demo /home/pdserve \
 && python3 -m venv "$VIRTUAL_ENV"

# Layers from the least to the most often changed: torch, then pdserve's dependencies (from pyproject
# alone), then the code (README included). A code or docs change rebuilds only the last steps.
RUN --mount=type=bind,source=pip-local,target=/pip-local \
    PIP_CONFIG_FILE=/pip-local/pip.conf pip install --find-links /pip-local --index-url "${TORCH_INDEX_URL}" \
    "torch==${TORCH_VERSION}"

WORKDIR /opt/pdserve
COPY pyproject.toml ./
RUN --mount=type=bind,source=pip-local,target=/pip-local \
    python -c 'import os, re, tomllib; skip = os.environ["SKIP_DEPS"].split(); \
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
print("\n".join(d for d in deps if re.match(r"[\w.-]+", d).group(0) not in skip))' > /tmp/requirements.txt \
 && PIP_CONFIG_FILE=/pip-local/pip.conf pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt

COPY README.md ./
COPY pdserve ./pdserve
COPY engine ./engine
COPY kernels ./kernels
COPY control ./control
COPY kvtransfer ./kvtransfer
COPY prefill ./prefill
COPY decode ./decode
COPY dualrole ./dualrole
COPY router ./router
COPY bench ./bench
COPY planner ./planner
RUN --mount=type=bind,source=pip-local,target=/pip-local \
    PIP_CONFIG_FILE=/pip-local/pip.conf pip install --no-deps . && rm -rf build
COPY docker/entrypoint.sh /usr/local/bin/pdserve-entrypoint

USER pdserve
# Out of the source tree: its pdserve/ folder would shadow the installed package for `python -m pdserve...`
WORKDIR /home/pdserve
# 8000 HTTP API (router), 7000 engine registration (router), 5600 engine control, 5700 prefill KV
EXPOSE 8000 7000 5600 5700
ENTRYPOINT ["pdserve-entrypoint"]
CMD ["up", "--host", "0.0.0.0"]
