"""Kubernetes manifests and container files for gpuplane; `python -m deploy.render` renders them."""
