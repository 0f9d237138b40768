"""TLS for specmesh's gRPC and HTTP ports, from PEM files (Kubernetes Secrets, cert-manager's included).

Each service takes ``--tls-cert`` and ``--tls-key`` (its certificate: served, and presented to the
services it calls) and ``--tls-ca`` (the cluster's CA: which peers to trust). Drafters and verifiers,
given a CA, require a client certificate it signed (mutual TLS): only the cluster's own router and
operators may call them. The router's public ports serve TLS without asking clients for a certificate
(clients bring API keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh.errors import InvalidArgument


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path | None = None

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """None when no flag is given; a clear error for half a configuration or a missing file."""
        if not (cert or key or ca):
            return None
        if not (cert and key):
            raise InvalidArgument("tls_cert", "give both --tls-cert and --tls-key (PEM files)")
        files = cls(Path(cert), Path(key), Path(ca) if ca else None)
        for flag, path in (("tls_cert", files.cert), ("tls_key", files.key), ("tls_ca", files.ca)):
            if path is not None and not path.is_file():
                raise InvalidArgument(flag, f"{path} is not a file")
        return files

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes() if self.ca else None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        if require_client_cert and ca is None:
            raise InvalidArgument("tls_ca", "mutual TLS needs the cluster's CA (--tls-ca) to check callers")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca if require_client_cert else None,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """To call a cluster service: trust the CA, present this certificate."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel_options(server_name: str | None) -> list[tuple[str, str]]:
    """gRPC options to expect ``server_name`` in the peer's certificate whatever address was dialled (a pod
    IP found by discovery is rarely among a certificate's names)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []
