"""The GPU worker: runs model graphs on one GPU with bounded kernel and plan caches."""
