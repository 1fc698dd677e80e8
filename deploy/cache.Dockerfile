# syntax=docker/dockerfile:1.7
# Kernel cache service image: slim Python base, the project and its exact pins from PyPI, non-root.
# Build from the repository root:
#   docker build -f deploy/cache.Dockerfile -t gpuplane/cache:0.1.0 .
# Nothing is downloaded at build time except the base image and the package registries.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY gen/ gen/
COPY services/ services/
COPY cache_service/ cache_service/
COPY gpu_worker/ gpu_worker/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -c constraints.txt .

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 gpuplane \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin gpuplane \
    && mkdir -p /data && chown 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# Numeric, so Kubernetes can verify runAsNonRoot without looking the name up.
USER 10001:10001
VOLUME ["/data"]
EXPOSE 50051 9090
ENTRYPOINT ["python", "-m", "cache_service"]
CMD ["serve", "--listen=0.0.0.0:50051", "--db=/data/kernel_cache.sqlite", "--metrics-port=9090"]
