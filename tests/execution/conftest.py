"""Executor and model tests run on a sim device with real NVRTC (fixtures in tests/sim_fixtures.py)."""
from tests.sim_fixtures import compiler, device, kernel_cache_dir  # noqa: F401
