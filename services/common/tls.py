"""TLS for servers and channels, with a server's certificates re-read when their files change.

Hazard: certificates are renewed on disk before they expire (cert-manager rewrites the mounted
Secret); a server that read them once serves the old one until it expires and then refuses every
handshake, and restarting to pick up the new one cuts in-flight `Generate` streams.
Contract: a server re-reads its certificate, key and client CA when the (mtime, size) of any of
their files changes. The check runs in gRPC's certificate fetcher, which gRPC calls before each new
connection's handshake, so new connections get the new certificate while connections already open
keep theirs (a running stream completes). A pair that does not match (a half-written rotation) is
logged and the previous pair kept; the next connection tries again.
Cost: three stat calls per new connection; nothing per call.
A client with a certificate of its own gets the same from `services.common.reloading_channel`:
gRPC has no reloading channel credentials, so that module opens a new channel when the files change.
Not possible here: an audit line for a refused handshake. gRPC Python calls nothing after a
handshake fails, the fetcher below learns neither the peer nor the outcome, and server credentials
either require a client certificate or never ask for one (none asks without requiring, which would
let the authorization interceptor refuse, and audit, a caller without one). gRPC core's own trace
(`GRPC_VERBOSITY=debug GRPC_TRACE=handshaker`) logs each failure with the peer (docs/security.md).
"""
from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.errors import InvalidArgument

log = logging.getLogger(__name__)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise InvalidArgument(f"cannot read the {what} {path!r}: {err.strerror}") from None


def file_stamp(paths: list[str]) -> tuple[tuple[int, int], ...]:
    """(mtime_ns, size) of each file, (-1, -1) for one that is missing: changes when any does."""
    stamps = []
    for f in paths:
        try:
            st = os.stat(f)
            stamps.append((st.st_mtime_ns, st.st_size))
        except OSError:
            stamps.append((-1, -1))
    return tuple(stamps)


def _check_pair(cert_file: str, key_file: str) -> None:
    """Raise InvalidArgument unless the key matches the certificate (checked by OpenSSL)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as err:
        raise InvalidArgument(
            f"TLS certificate {cert_file!r} and key {key_file!r} do not form a pair ({err}); "
            "give the PEM certificate chain and its unencrypted PEM private key") from None


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key; with `client_ca_file`, mutual TLS (clients must present a
    certificate signed by that CA, or the handshake fails)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def _files(self) -> list[str]:
        return [f for f in (self.cert_file, self.key_file, self.client_ca_file) if f]


class _ReloadingCertificate:
    """gRPC's certificate fetcher: a new configuration when the files changed, else None."""

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._lock = threading.Lock()  # gRPC may call the fetcher from several threads
        self._stamp = self._stat()
        self.initial = self._load()
        self.reloads = 0

    def _stat(self) -> tuple[tuple[int, int], ...]:
        return file_stamp(self.tls._files())

    def _load(self) -> grpc.ServerCertificateConfiguration:
        t = self.tls
        cert, key = _read(t.cert_file, "TLS certificate"), _read(t.key_file, "TLS key")
        ca = _read(t.client_ca_file, "client CA") if t.client_ca_file else None
        _check_pair(t.cert_file, t.key_file)
        # The pair was checked from the files; if they changed meanwhile, what we read may be
        # mixed, so read again until two reads agree.
        if _read(t.cert_file, "TLS certificate") != cert or _read(t.key_file, "TLS key") != key:
            raise InvalidArgument("TLS files changed while being read; will retry")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            try:
                config = self._load()
            except InvalidArgument as err:
                log.warning("TLS files changed but cannot be loaded; keeping the previous "
                            "certificate", extra={"reason": err.message})
                return None
            self._stamp = stamp
            self.reloads += 1
            log.info("TLS certificate reloaded", extra={"cert": self.tls.cert_file,
                                                       "reloads": self.reloads})
            return config


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """Credentials that re-read `tls`'s files at each new connection when they changed."""
    fetcher = _ReloadingCertificate(tls)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial, fetcher, require_client_authentication=tls.mutual)


@dataclass(frozen=True)
class ChannelTLS:
    """A client's view: the CA that signs the servers, and (for mutual TLS) its own pair."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("a client certificate needs its key and a key its certificate "
                                  "(give both --tls-cert and --tls-key)")

    def stamp(self) -> tuple[tuple[int, int], ...]:
        return file_stamp([f for f in (self.ca_file, self.cert_file, self.key_file) if f])

    def credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca_file, "TLS CA") if self.ca_file else None
        if self.cert_file and self.key_file:
            _check_pair(self.cert_file, self.key_file)
            return grpc.ssl_channel_credentials(
                ca, _read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate"))
        return grpc.ssl_channel_credentials(ca)
