# syntax=docker/dockerfile:1.7
# GPU worker image: CUDA runtime base (the driver's libcuda comes from the node through the
# NVIDIA container toolkit), Python from the distribution, the project and its exact pins from
# PyPI. Build from the repository root:
#   docker build -f deploy/worker.Dockerfile -t gpuplane/worker:0.1.0 .
# Nothing is downloaded at build time except the base image and the package registries.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY gen/ gen/
COPY services/ services/
COPY cache_service/ cache_service/
COPY gpu_worker/ gpu_worker/
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
       -c constraints.txt '.[cuda]'

FROM ${CUDA_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 gpuplane \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin gpuplane
# Same base and same python3 package as the build stage, so the venv's interpreter link holds.
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# Numeric, so Kubernetes can verify runAsNonRoot without looking the name up.
USER 10001:10001
EXPOSE 50071 9090
ENTRYPOINT ["python", "-m", "gpu_worker"]
CMD ["serve", "--listen=0.0.0.0:50071", "--backend=cuda", "--cache-dir=/cache", "--metrics-port=9090"]
