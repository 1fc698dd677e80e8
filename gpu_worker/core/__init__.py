"""The worker's domain core: the runtime, loaded models, admission, reclaim, token streams and
stats. Never imports `grpc`: the edge converts messages and maps `services.common.errors` to codes."""
