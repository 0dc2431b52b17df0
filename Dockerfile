# pdserve: router and engines in one image; the command picks the role (see compose.yaml).
#
#   docker build -t pdserve .                                   # CUDA torch (PyPI's Linux wheel)
#   docker build -t pdserve:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker run --rm -p 8000:8000 pdserve up --host 0.0.0.0      # demo model, 1 prefill + 1 decode, CPU
#
# It runs as the unprivileged user `pdserve` (uid 1000). OMP_NUM_THREADS defaults to the container's
# cores (docker/entrypoint.sh); set it to override.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/home/pdserve/.cache/huggingface \
    PDSERVE_CACHE=/home/pdserve/.cache/pdserve

# torch first, from the chosen index, so `pip install .` finds it satisfied and pulls nothing bigger.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
COPY engine ./engine
COPY kernels ./kernels
COPY control ./control
COPY kvtransfer ./kvtransfer
COPY prefill ./prefill
COPY decode ./decode
COPY router ./router
COPY bench ./bench
RUN pip install .
COPY docker/entrypoint.sh /usr/local/bin/pdserve-entrypoint

# The mount points of compose's volumes exist, owned by the user, so new volumes are writable by it.
RUN useradd --create-home --uid 1000 --user-group pdserve \
    && mkdir -p "${HF_HOME}" "${PDSERVE_CACHE}" /keys /demo \
    && chown -R pdserve:pdserve /home/pdserve /keys /demo
USER pdserve
WORKDIR /home/pdserve

# 8000 HTTP API (router), 7000 engine registration (router), 5600 engine control, 5700 prefill KV
EXPOSE 8000 7000 5600 5700
ENTRYPOINT ["pdserve-entrypoint"]
CMD ["up", "--host", "0.0.0.0"]
