"""Certificates made on the spot for TLS tests and bench/tls_bench.py: a CA and the leaves it signs.

Real X.509 (cryptography, a dev dependency), EC P-256, written as PEM files the services read the
way they read mounted Secrets in a cluster.
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class Leaf:
    cert: Path
    key: Path
    serial: int


class CertificateAuthority:
    """A self-signed CA in `folder/<name>-ca.pem` that issues leaves for servers and clients."""

    def __init__(self, folder: Path, name: str = "gpuplane-test") -> None:
        self.folder, self.name = Path(folder), name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self.key, hashes.SHA256()))
        self.ca_file = self.folder / f"{name}-ca.pem"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, uris: tuple[str, ...] = (), dns: tuple[str, ...] = ("localhost",),
              ips: tuple[str, ...] = ("127.0.0.1",), cert_path: Path | None = None,
              key_path: Path | None = None) -> Leaf:
        """A leaf usable as server and client, with the given SANs; written to the paths (default
        `folder/<stem>.pem` and `<stem>-key.pem`), replaced atomically so a reader never sees a
        half-written file."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        serial = x509.random_serial_number()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stem)]))
            .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256()))
        cert_path = cert_path or self.folder / f"{stem}.pem"
        key_path = key_path or self.folder / f"{stem}-key.pem"
        for path, data in ((key_path, _pem_key(key)),
                           (cert_path, cert.public_bytes(serialization.Encoding.PEM))):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return Leaf(cert_path, key_path, serial)
