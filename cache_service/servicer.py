"""KernelCacheService over gRPC: validate, convert, call the ArtifactStore, convert back."""
from __future__ import annotations

from typing import Any

import grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

from cache_service.claims import ClaimStats, ClaimTable, Outcome
from cache_service.convert import artifact_from_pb, artifact_to_pb, found_response_bytes
from cache_service.store import (
    OMITTED,
    ArtifactStore,
    CacheStats,
    normalize_namespace,
    validate_key,
)
from services.common.errors import InvalidArgument
from services.common.server import MAX_MESSAGE_BYTES

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KernelCacheService"].full_name
MAX_BATCH_KEYS = 4096
# A BatchLookup response carries at most this much artifact data; the rest is marked `omitted`
# and fetched by the client in a follow-up call, so a response never hits the message limit.
BATCH_RESPONSE_BYTES = MAX_MESSAGE_BYTES // 2


_MISS = pb.LookupResponse(found=False)
_OUTCOME_TO_PB = {Outcome.GRANTED: pb.CLAIM_OUTCOME_GRANTED, Outcome.FOUND: pb.CLAIM_OUTCOME_FOUND,
                  Outcome.HELD: pb.CLAIM_OUTCOME_HELD}


def stats_to_pb(s: CacheStats, c: ClaimStats) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        claims=pb.ClaimStats(granted=c.granted, waits=c.waits, wait_hits=c.wait_hits,
                             expired=c.expired, released=c.released, active=c.active,
                             waiting=c.waiting, renewed=c.renewed),
        entries=s.entries, total_bytes=s.total_bytes, budget_bytes=s.budget_bytes, hits=s.hits,
        misses=s.misses, evictions=s.evictions, stores=s.stores, corrupt=s.corrupt,
        digest_conflicts=s.digest_conflicts, compile_seconds_saved=s.compile_seconds_saved,
        db_file_bytes=s.db_file_bytes, quarantined=s.quarantined,
        max_artifact_bytes=s.max_artifact_bytes, low_watermark=s.low_watermark,
        hot_entries=s.hot_entries, hot_bytes=s.hot_bytes, hot_budget_bytes=s.hot_budget_bytes,
        hot_hits=s.hot_hits, bytes_served=s.bytes_served,
        namespaces=[pb.NamespaceStats(namespace=n.namespace, entries=n.entries,
                                      total_bytes=n.total_bytes, budget_bytes=n.budget_bytes)
                    for n in s.namespaces],
    )


class KernelCacheServicer(pb_grpc.KernelCacheServiceServicer):
    def __init__(self, store: ArtifactStore, claims: ClaimTable,
                 batch_response_bytes: int = BATCH_RESPONSE_BYTES) -> None:
        self.store = store
        self.claims = claims
        self.batch_response_bytes = batch_response_bytes

    def Store(self, request: pb.StoreRequest, context: grpc.ServicerContext) -> pb.StoreResponse:
        if not request.HasField("artifact"):
            raise InvalidArgument("artifact is required")
        artifact, claimed = artifact_from_pb(request.artifact)
        outcome = self.store.store(request.key, artifact, request.namespace, sha256=claimed)
        return pb.StoreResponse(stored=outcome.stored, digest_conflict=outcome.digest_conflict,
                                evicted_entries=outcome.evicted_entries)

    def Lookup(self, request: pb.LookupRequest,
               context: grpc.ServicerContext) -> pb.LookupResponse | bytes:
        """A hit is answered with its serialized response (kept in the hot tier once made); see
        `add_to_server`, which lets those bytes through Lookup's serializer unchanged."""
        encoded = self.store.lookup_encoded(request.key, request.namespace, found_response_bytes)
        return _MISS if encoded is None else encoded

    def BatchLookup(self, request: pb.BatchLookupRequest,
                    context: grpc.ServicerContext) -> pb.BatchLookupResponse:
        if len(request.keys) > MAX_BATCH_KEYS:
            raise InvalidArgument(f"{len(request.keys)} keys in one BatchLookup; at most "
                                  f"{MAX_BATCH_KEYS} (split the request)")
        results = self.store.batch_lookup(list(request.keys), request.namespace,
                                          max_bytes=self.batch_response_bytes)
        out = pb.BatchLookupResponse()
        for r in results:
            if r is OMITTED:
                out.results.add(found=False, omitted=True)
            elif r is None:
                out.results.add(found=False)
            else:
                artifact_to_pb(r, into=out.results.add(found=True).artifact)
        return out

    def GetStats(self, request: pb.GetStatsRequest,
                 context: grpc.ServicerContext) -> pb.GetStatsResponse:
        return stats_to_pb(self.store.stats(), self.claims.stats())

    def Prune(self, request: pb.PruneRequest, context: grpc.ServicerContext) -> pb.PruneResponse:
        outcome = self.store.prune(request.target_bytes)
        return pb.PruneResponse(evicted_entries=outcome.evicted_entries,
                                freed_bytes=outcome.freed_bytes, total_bytes=outcome.total_bytes)

    def Claim(self, request: pb.ClaimRequest, context: grpc.ServicerContext) -> pb.ClaimResponse:
        # A claim makes other hosts wait: only writers may take one.
        entry = (normalize_namespace(request.namespace), validate_key(request.key))
        # Never wait past the caller's own deadline, less a margin for the answer to get back
        # (a tenth of what is left, at least 50 ms: an answer that misses it is a lost wait).
        left = context.time_remaining()
        margin = 0.0 if left is None else max(0.05, 0.1 * left)
        wait_s = request.wait_s if left is None else min(request.wait_s, max(0.0, left - margin))
        self.claims.validate(request.holder, request.ttl_s, request.wait_s)
        result = self.claims.claim(entry, request.holder, request.ttl_s, wait_s,
                                   lambda: self.store.lookup_present(request.key, request.namespace))
        response = pb.ClaimResponse(outcome=_OUTCOME_TO_PB[result.outcome],
                                    expires_in_s=result.expires_in_s, took_over=result.took_over,
                                    retry_after_s=result.retry_after_s, waited=result.waited)
        if result.found is not None:
            artifact_to_pb(result.found, into=response.artifact)
        return response

    def ReleaseClaim(self, request: pb.ReleaseClaimRequest,
                     context: grpc.ServicerContext) -> pb.ReleaseClaimResponse:
        entry = (normalize_namespace(request.namespace), validate_key(request.key))
        return pb.ReleaseClaimResponse(released=self.claims.release(entry, request.holder))


def _message_or_encoded(response: Any) -> bytes:
    """Lookup's serializer: a message is serialized, bytes (an encoded hit) are sent as they are."""
    return response if isinstance(response, bytes) else response.SerializeToString()


class _LookupSendsEncoded:
    """Stands in for the server while the generated code registers the servicer: the method
    table it passes is registered as given, except that Lookup's serializer also takes bytes.
    (The generated code registers one table twice, as a generic handler and as registered
    methods; both are made here from the second call, so nothing is registered twice.)"""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # made below from the same method table

    def add_registered_method_handlers(self, service: str, method_handlers: dict) -> None:
        table = dict(method_handlers)
        lookup = table["Lookup"]
        table["Lookup"] = grpc.unary_unary_rpc_method_handler(
            lookup.unary_unary, lookup.request_deserializer, _message_or_encoded)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, table),))
        self._server.add_registered_method_handlers(service, table)


def add_to_server(servicer: KernelCacheServicer, server: grpc.Server) -> None:
    """`add_KernelCacheServiceServicer_to_server`, with Lookup able to answer pre-serialized."""
    pb_grpc.add_KernelCacheServiceServicer_to_server(servicer, _LookupSendsEncoded(server))
