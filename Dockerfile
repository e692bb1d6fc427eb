# syntax=docker/dockerfile:1
# neuron-serve serving image. Without Neuron devices it emulates NeuronCores on XLA:CPU;
# Dockerfile.neuron builds the variant with the Neuron SDK for Inf2/Trn1 nodes.
#
#   docker build -t neuron-serve:0.1.0 .
#   docker run --rm -p 8000:8000 neuron-serve:0.1.0 \
#       deploy /app/deployments/mlp.yaml --host 0.0.0.0 --port 8000

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# The same install as the README's: pip installs the project, and pyproject.toml pins
# torch==2.9.0 and torch-xla==2.9.0. README.md is the package's readme, so the build needs it.
COPY pyproject.toml README.md ./
COPY neuron_serve ./neuron_serve
RUN pip install --upgrade pip && pip install .

FROM python:${PYTHON_VERSION}-slim
# wget: KubeRay's default Ray health probes (rayservice mode) call it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/app --shell /bin/bash app
COPY --from=build /opt/venv /opt/venv
COPY --chown=1000:1000 deployments /app/deployments
RUN mkdir -p /var/cache/neuron-serve && chown 1000:1000 /var/cache/neuron-serve
# /app/deployments on the path makes the examples' factories (example_models.mlp:build)
# importable from a model.yaml mounted anywhere, e.g. the Helm chart's ConfigMap.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app/deployments \
    PYTHONUNBUFFERED=1 \
    NEURON_SERVE_CACHE_DIR=/var/cache/neuron-serve
WORKDIR /app
USER 1000:1000
# 8000: HTTP (Open Inference Protocol v2, and /metrics). 8080: Ray's metrics export port
# when KubeRay starts Ray in this image (the Helm chart's rayservice mode).
EXPOSE 8000 8080
ENTRYPOINT ["neuron-serve"]
CMD ["deploy", "/app/deployments/mlp.yaml", "--host", "0.0.0.0", "--port", "8000"]
