"""Certificates for the TLS tests: the cluster's (its CA and a certificate for 127.0.0.1/localhost) and an
outsider's (the same names, signed by an unrelated CA)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specmesh.cluster.pki import local_pki
from specmesh.cluster.tls import TlsFiles


@dataclass(frozen=True)
class Pki:
    ca: Path
    service: TlsFiles
    outsider: TlsFiles


def make_pki(directory: Path) -> Pki:
    mine, outsider = local_pki(directory / "cluster"), local_pki(directory / "outsider")
    return Pki(mine.ca, mine, outsider)
