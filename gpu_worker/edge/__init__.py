"""The worker's gRPC edge: the servicer, message conversion, access roles, metrics, the client and
the `gpuplane` CLI. These are the only modules of `gpu_worker` that import `grpc`."""
