"""The verifiers' control API from the operator's side: ``Info`` and ``Drain`` with the cluster's
credential — its certificate where the cluster runs mutual TLS, else the queue key's control token
(``QueueSigner.control_token``); the verifier refuses anyone else."""

from __future__ import annotations

import grpc
from google.protobuf.json_format import MessageToDict

from specmesh.cluster.pipeline.messages import QueueSigner
from specmesh.cluster.tls import TlsFiles, channel_options
from specmesh.errors import InvalidArgument
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

ACTIONS = ("info", "drain")


def call_verifier(address: str, action: str, signer: QueueSigner, tls: TlsFiles | None = None,
                  server_name: str | None = None, timeout_s: float = 10.0) -> dict:
    """The verifier's answer to ``action`` as a dict; a refusal or an unreachable verifier raises
    ``grpc.RpcError``."""
    if action not in ACTIONS:
        raise InvalidArgument("action", f"is {action!r}; use one of {', '.join(ACTIONS)}")
    mutual = tls is not None and tls.ca is not None
    token = None if mutual else signer.control_token()
    if not mutual and token is None:
        raise InvalidArgument("queue_key", "the control API needs the cluster's queue key (SPECMESH_QUEUE_KEY or "
                                           "--queue-key-file), or its certificates (--tls-cert, --tls-key, --tls-ca)")
    metadata = [("authorization", f"Bearer {token}")] if token else []
    channel = (grpc.secure_channel(address, tls.channel_credentials(), options=channel_options(server_name)) if mutual
               else grpc.insecure_channel(address))
    with channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        if action == "info":
            answer = stub.Info(verifier_pb2.VerifierInfoRequest(), metadata=metadata, timeout=timeout_s)
        else:
            answer = stub.Drain(verifier_pb2.DrainRequest(), metadata=metadata, timeout=timeout_s)
    return MessageToDict(answer, preserving_proto_field_name=True)
