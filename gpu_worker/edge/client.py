"""A client for WorkerService: what users, the demo and the tests call.

Every call carries a deadline. Read-only calls (ListModels, GetStats) are retried on UNAVAILABLE by
the channel's service config; LoadModel, Generate, Embed and Trim are not (they are not idempotent,
or a retry would silently repeat work). Errors surface as `grpc.RpcError` with the server's status.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Self

import grpc
import numpy as np
from gpuplane.worker.v1 import worker_pb2, worker_pb2_grpc

from services.common.channels import open_channel
from services.common.tls import ChannelTLS

SERVICE = "gpuplane.worker.v1.WorkerService"
IDEMPOTENT = ("ListModels", "GetStats")


@dataclass
class GenerateResult:
    """One finished Generate call, as seen by the client."""

    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    first_token_seconds: float = 0.0  # measured by the server, from request to first token
    client_first_token_seconds: float = 0.0  # measured here, includes the network
    latency_seconds: float = 0.0
    finish_reason: str = ""           # "length", "stop" or "cancelled" (from the done message)


class WorkerClient:
    def __init__(self, target: str, deadline_s: float = 30.0, load_deadline_s: float = 600.0,
                 tracer_provider=None, tls: ChannelTLS | None = None,
                 token: str | None = None) -> None:
        self.target = target
        self.deadline_s = deadline_s
        self.load_deadline_s = load_deadline_s
        self.channel = open_channel(target, SERVICE, IDEMPOTENT, tracer_provider=tracer_provider,
                                    tls=tls, metadata_token=token)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)

    def load_model(self, model_id: str, family: str = "decoder", config: str = "tiny", seed: int = 0,
                   timeout: float | None = None) -> worker_pb2.LoadModelResponse:
        request = worker_pb2.LoadModelRequest(model_id=model_id, family=family, config=config, seed=seed)
        return self.stub.LoadModel(request, timeout=timeout or self.load_deadline_s)

    def load_checkpoint(self, model_id: str, checkpoint: str, weight_format: str = "",
                        timeout: float | None = None) -> worker_pb2.LoadModelResponse:
        """A Hugging Face checkpoint directory under the worker's --model-root."""
        request = worker_pb2.LoadModelRequest(model_id=model_id, checkpoint=checkpoint,
                                              weight_format=weight_format)
        return self.stub.LoadModel(request, timeout=timeout or self.load_deadline_s)

    def unload_model(self, model_id: str) -> int:
        request = worker_pb2.UnloadModelRequest(model_id=model_id)
        return self.stub.UnloadModel(request, timeout=self.deadline_s).freed_bytes

    def offload_model(self, model_id: str) -> worker_pb2.OffloadModelResponse:
        request = worker_pb2.OffloadModelRequest(model_id=model_id)
        return self.stub.OffloadModel(request, timeout=self.deadline_s)

    def list_models(self) -> list[worker_pb2.ModelInfo]:
        return list(self.stub.ListModels(worker_pb2.ListModelsRequest(), timeout=self.deadline_s).models)

    def generate_stream(self, model_id: str, prompt_tokens: list[int], max_new_tokens: int,
                        timeout: float | None = None, prompt: str = "",
                        sampling: dict | None = None) -> Iterator[worker_pb2.GenerateResponse]:
        """The raw response stream; cancel it with `.cancel()` on the returned call object.
        `prompt` (text) replaces `prompt_tokens` for a model with a tokenizer; `sampling` holds
        SamplingParams fields (None: greedy)."""
        request = worker_pb2.GenerateRequest(model_id=model_id, prompt_tokens=prompt_tokens,
                                             max_new_tokens=max_new_tokens, prompt=prompt)
        if sampling is not None:
            request.sampling.CopyFrom(worker_pb2.SamplingParams(**sampling))
        return self.stub.Generate(request, timeout=timeout or self.deadline_s)

    def generate(self, model_id: str, prompt_tokens: list[int], max_new_tokens: int,
                 timeout: float | None = None, sampling: dict | None = None) -> GenerateResult:
        """Run one Generate to completion and collect its tokens and timings."""
        started = time.perf_counter()
        result = GenerateResult(prompt_tokens=len(prompt_tokens))
        for message in self.generate_stream(model_id, prompt_tokens, max_new_tokens, timeout,
                                            sampling=sampling):
            result.finish_reason = message.finish_reason or result.finish_reason
            if message.tokens and not result.tokens:
                result.client_first_token_seconds = time.perf_counter() - started
            if message.first_token_seconds:
                result.first_token_seconds = message.first_token_seconds
            result.tokens.extend(message.tokens)
        result.latency_seconds = time.perf_counter() - started
        return result

    def embed(self, model_id: str, sequences: list[list[int]], timeout: float | None = None
              ) -> np.ndarray:
        request = worker_pb2.EmbedRequest(
            model_id=model_id, sequences=[worker_pb2.TokenSequence(tokens=s) for s in sequences])
        response = self.stub.Embed(request, timeout=timeout or self.deadline_s)
        return np.array([list(e.values) for e in response.embeddings], dtype=np.float32)

    def embed_texts(self, model_id: str, texts: list[str], timeout: float | None = None
                    ) -> np.ndarray:
        """Embeddings of `texts` (any lengths) by a model with a tokenizer, in order."""
        request = worker_pb2.EmbedRequest(model_id=model_id, texts=texts)
        response = self.stub.Embed(request, timeout=timeout or self.deadline_s)
        return np.array([list(e.values) for e in response.embeddings], dtype=np.float32)

    def stats(self) -> worker_pb2.GetStatsResponse:
        return self.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=self.deadline_s)

    def trim(self, target_bytes: int) -> worker_pb2.TrimResponse:
        return self.stub.Trim(worker_pb2.TrimRequest(target_bytes=target_bytes), timeout=self.deadline_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_health(target: str, timeout_s: float = 60.0, service: str = "") -> None:
    """Block until `target` answers SERVING on grpc.health.v1, or raise TimeoutError."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.05)
    raise TimeoutError(f"{target} did not become healthy within {timeout_s:.0f}s (last: {last})")
