"""A cluster CA of its own for a cluster on one machine (``specmesh up --tls``, the benchmark's secured
cluster): one certificate for 127.0.0.1 and localhost that every service serves and presents."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from specmesh.cluster.tls import TlsFiles

VALID_FOR = datetime.timedelta(days=30)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def local_pki(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """A new CA and a certificate it signed for ``hosts`` (server and client use), as PEM files in
    ``directory``: ``ca.crt``, ``service.crt``, ``service.key``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + VALID_FOR))

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (builder("specmesh local cluster CA", name("specmesh local cluster CA"), ca_key)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(ca_key, hashes.SHA256()))
    names = [x509.IPAddress(ipaddress.ip_address(h)) if h.replace(".", "").isdigit() else x509.DNSName(h) for h in hosts]
    leaf = (builder("specmesh service", ca.subject, key)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    ca_path = _write(directory / "ca.crt", ca.public_bytes(pem))
    cert_path = _write(directory / "service.crt", leaf.public_bytes(pem))
    key_path = _write(directory / "service.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                   serialization.NoEncryption()))
    return TlsFiles(cert_path, key_path, ca_path)
