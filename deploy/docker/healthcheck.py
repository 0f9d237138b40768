"""The image's HEALTHCHECK (docker, compose; Kubernetes uses its own gRPC probes instead): the standard
gRPC health check of the service this container runs, exit 0 when it is SERVING.

The port is the service's --listen / SPECMESH_LISTEN, read from the container's main process (PID 1),
else the service's default port.
"""

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_PORTS = {"router": 50051, "drafter": 50061, "verifier": 50071}


def listen_address(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--listen" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--listen="):
            return arg.split("=", 1)[1]
    if os.environ.get("SPECMESH_LISTEN"):
        return os.environ["SPECMESH_LISTEN"]
    service = next((a.rsplit(".", 1)[-1] for a in argv if a.startswith("specmesh.services.")), "router")
    return f"127.0.0.1:{DEFAULT_PORTS.get(service, DEFAULT_PORTS['router'])}"


def main() -> int:
    try:
        argv = Path("/proc/1/cmdline").read_bytes().decode().split("\0")
    except OSError:
        argv = []
    port = listen_address(argv).rsplit(":", 1)[-1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}", file=sys.stderr)
            return 1
    serving = answer.status == health_pb2.HealthCheckResponse.SERVING
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
