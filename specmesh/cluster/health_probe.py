"""``python -m specmesh.cluster.health_probe``: the standard gRPC health check of the service in this
container, exit 0 when it is SERVING: the image's HEALTHCHECK (docker, compose), and the chart's exec
probes when the services speak TLS (the kubelet's own gRPC probes speak plaintext only).

It reads what the service reads: ``--listen`` and ``--tls-*`` from the container's main process (PID 1)
or their ``SPECMESH_*`` variables, else the service's default port. Over TLS it presents the service's
own certificate (mutual TLS) and expects the certificate's first DNS name, as it dials loopback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.cluster.tls import TlsFiles

DEFAULT_PORTS = {"router": 50051, "drafter": 50061, "verifier": 50071}


def flag(argv: list[str], name: str) -> str | None:
    """``--name VALUE`` or ``--name=VALUE`` in ``argv``, else ``$SPECMESH_NAME``."""
    for i, arg in enumerate(argv):
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return os.environ.get(f"SPECMESH_{name.upper().replace('-', '_')}") or None


def listen_address(argv: list[str]) -> str:
    service = next((a.rsplit(".", 1)[-1] for a in argv if a.startswith("specmesh.services.")), "router")
    return flag(argv, "listen") or f"127.0.0.1:{DEFAULT_PORTS.get(service, DEFAULT_PORTS['router'])}"


def certificate_name(cert_pem: bytes) -> str | None:
    """The first DNS name the certificate is for (what the client must expect when dialling 127.0.0.1)."""
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(cert_pem)
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    dns = names.get_values_for_type(x509.DNSName)
    return dns[0] if dns else None


def check(listen: str, tls: TlsFiles | None, timeout_s: float = 3.0) -> bool:
    address = f"127.0.0.1:{listen.rpartition(':')[2]}"
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        name = certificate_name(tls.cert.read_bytes())
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
    with channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}", file=sys.stderr)
            return False
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        try:
            argv = Path("/proc/1/cmdline").read_bytes().decode().split("\0")
        except OSError:
            argv = []
    tls = TlsFiles.from_flags(flag(argv, "tls-cert"), flag(argv, "tls-key"), flag(argv, "tls-ca"))
    return 0 if check(listen_address(argv), tls) else 1


if __name__ == "__main__":
    sys.exit(main())
