# syntax=docker/dockerfile:1
# One image, three entrypoints:  sluice operator | sluice router | sluice worker
#
#   docker build -t sluice:0.1.0 .
#   docker run --rm -p 8000:8000 sluice:0.1.0 worker --host 0.0.0.0 --model SmolLM2-135M-Instruct
#
# CPU PyTorch comes from the PyTorch CPU index (PyPI's torch is the CUDA build, ~5 GB larger).
# For GPUs, build with --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (or
# another CUDA index). Models are not in this image: the operator's init container fetches
# them (worker.modelCache), or use docker/worker-cpu.Dockerfile, which bakes one in.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from its own index; pyproject's torch==X then matches X+cpu already installed.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sluice ./sluice
RUN pip install .

FROM ${PYTHON_IMAGE}
ARG UID=1000
RUN groupadd --gid "${UID}" sluice \
    && useradd --uid "${UID}" --gid sluice --create-home --home-dir /home/sluice \
       --shell /usr/sbin/nologin sluice \
    && install -d -o sluice -g sluice /var/lib/sluice
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOME=/var/lib/sluice \
    HOME=/home/sluice
USER ${UID}:${UID}
WORKDIR /home/sluice
# The router's and the worker's default port; the operator's liveness endpoint is on 8080.
EXPOSE 8000
ENTRYPOINT ["sluice"]
CMD ["--help"]
