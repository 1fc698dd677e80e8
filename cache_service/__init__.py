"""The kernel cache service: compiled NVRTC output (PTX and CUBIN) in SQLite under LRU byte budgets,
shared by every worker host over gRPC.

Workers: `from cache_service.client import KernelCacheClient` and `from cache_service.artifact
import Artifact`. Operators: `python -m cache_service serve|stats|lookup|prune`. The package root
imports nothing, so the domain core (`cache_service.store`) loads without grpc.
"""
