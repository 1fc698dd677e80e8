from tests.sim_fixtures import compiler, device, kernel_cache_dir  # noqa: F401
