"""Certificates for the TLS tests: a cluster CA, a certificate for 127.0.0.1/localhost, and a second,
unrelated CA (an outsider's), as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specmesh.cluster.tls import TlsFiles


@dataclass(frozen=True)
class Pki:
    ca: Path
    service: TlsFiles  # 127.0.0.1 / localhost, signed by ca, for servers and clients alike
    outsider: TlsFiles  # the same names, signed by another CA


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(directory: Path, stem: str, certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _authority(common: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .sign(key, hashes.SHA256()))
    return certificate, key


def _leaf(common: str, authority, authority_key):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    certificate = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(authority.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(names, critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                                  critical=False)
                   .sign(authority_key, hashes.SHA256()))
    return certificate, key


def make_pki(directory: Path) -> Pki:
    ca, ca_key = _authority("specmesh test CA")
    other, other_key = _authority("an outsider's CA")
    ca_path, _ = _write(directory, "ca", ca, ca_key)
    other_ca_path, _ = _write(directory, "outsider-ca", other, other_key)
    service = _write(directory, "service", *_leaf("specmesh service", ca, ca_key))
    outsider = _write(directory, "outsider", *_leaf("outsider", other, other_key))
    return Pki(ca_path, TlsFiles(*service, ca_path), TlsFiles(*outsider, other_ca_path))
