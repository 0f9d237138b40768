"""TLS: the router's client APIs (gRPC and HTTP) over TLS; drafters and the verifier's control API
answer only callers with a certificate from the cluster's CA (mutual TLS): no certificate, or one
from another CA, and the handshake is refused."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import openai
import pytest
from certs import make_pki
from cluster_parts import ServiceStack
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.client import AsyncClient
from specmesh.cluster.serving import start_server
from specmesh.cluster.tls import TlsFiles
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

CHAT = [("user", "one two three one two three")]


async def drafter_info(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """The drafter's answer to Info, or the status code that refused it."""
    channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
    async with channel:
        try:
            info = await drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(), timeout=5)
            return info.name
        except grpc.aio.AioRpcError as exc:
            return exc.code().name


def test_tls_outside_and_mutual_tls_inside(redis_server, model, tokenizer, tmp_path):
    pki = make_pki(tmp_path)
    mine, outsider = pki.service, pki.outsider
    ca = mine.ca.read_bytes()

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), http=True, tls=mine) as stack:
            drafter = f"127.0.0.1:{stack.drafter_server.port}"
            calls = {
                "plaintext": await drafter_info(drafter, None),
                "no client certificate": await drafter_info(drafter, grpc.ssl_channel_credentials(root_certificates=ca)),
                "an outsider's certificate": await drafter_info(drafter, grpc.ssl_channel_credentials(
                    root_certificates=ca, private_key=outsider.key.read_bytes(),
                    certificate_chain=outsider.cert.read_bytes())),
                "the cluster's certificate": await drafter_info(drafter, mine.channel_credentials()),
            }
            async with AsyncClient(stack.address, tls_ca=str(pki.ca), retries=0) as client:
                answer = await client.generate(chat=CHAT, max_tokens=8)
            refused = {}
            for name, kwargs in (("plaintext", {}), ("another CA", {"tls_ca": str(outsider.ca)})):
                async with AsyncClient(stack.address, retries=0, timeout_s=5, **kwargs) as client:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate(chat=CHAT, max_tokens=2)
                    refused[name] = err.value.code()
            trusted = openai.DefaultAsyncHttpx2Client(verify=ssl.create_default_context(cafile=str(pki.ca)))
            async with openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", http_client=trusted,
                                          max_retries=0) as client:
                over_https = await client.completions.create(model="tiny", prompt="one two", max_tokens=4)
            async with openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as client:
                with pytest.raises(openai.APIConnectionError):  # the system's roots do not know the cluster's CA
                    await client.models.list()
            # the verifier's control API: Drain takes a verifier out of service, so only the cluster may call it
            info = verifier_pb2.VerifierInfo(verifier_id="v0")
            control = await asyncio.to_thread(stack.pool.nodes[0].serve_control, info, tls=mine, require_client_cert=True)
            address = f"127.0.0.1:{control.port}"
            drains = {}
            for name, credentials in (("plaintext", None),
                                      ("no client certificate", grpc.ssl_channel_credentials(root_certificates=ca)),
                                      ("the cluster's certificate", mine.channel_credentials())):
                channel = (grpc.aio.secure_channel(address, credentials) if credentials
                           else grpc.aio.insecure_channel(address))
                async with channel:
                    try:
                        await verifier_pb2_grpc.VerifierStub(channel).Drain(verifier_pb2.DrainRequest(), timeout=5)
                        drains[name] = "OK"
                    except grpc.aio.AioRpcError as exc:
                        drains[name] = exc.code().name
            stack.pool.nodes[0].call(control.server.stop(0))
            return calls, answer, refused, over_https, drains, stack.remote.name

    calls, answer, refused, over_https, drains, drafter_name = asyncio.run(main())
    assert calls == {"plaintext": "UNAVAILABLE", "no client certificate": "UNAVAILABLE",
                     "an outsider's certificate": "UNAVAILABLE", "the cluster's certificate": drafter_name}
    assert len(answer.token_ids) == 8 and answer.stats.drafters  # drafted through mutual TLS
    assert set(refused.values()) == {grpc.StatusCode.UNAVAILABLE}
    assert len(over_https.choices[0].text) > 0 and over_https.usage.completion_tokens == 4
    assert drains == {"plaintext": "UNAVAILABLE", "no client certificate": "UNAVAILABLE", "the cluster's certificate": "OK"}


def test_half_a_tls_configuration_is_refused(tmp_path):
    assert TlsFiles.from_flags(None, None, None) is None
    with pytest.raises(InvalidArgument, match="--tls-key"):
        TlsFiles.from_flags(str(tmp_path / "a.crt"), None, None)
    with pytest.raises(InvalidArgument, match="not a file"):
        TlsFiles.from_flags(str(tmp_path / "a.crt"), str(tmp_path / "a.key"), None)
    pki = make_pki(tmp_path)
    without_ca = TlsFiles(pki.service.cert, pki.service.key)
    with pytest.raises(InvalidArgument, match="--tls-ca"):
        without_ca.server_credentials(require_client_cert=True)


def test_the_health_probe_checks_a_mutual_tls_service(tmp_path):
    """The image's HEALTHCHECK and the chart's exec probes under TLS: the service's own certificate gets
    through; the service's flags are read as it reads them."""
    from specmesh.cluster.health_probe import check, main

    pki = make_pki(tmp_path)

    async def serve_and_probe():
        server = await start_server([], "127.0.0.1:0", tls=pki.service, require_client_cert=True)
        listen = f"0.0.0.0:{server.port}"
        try:
            return await asyncio.to_thread(lambda: (
                check(listen, pki.service), check(listen, pki.outsider), check(listen, None),
                main(["python", "-m", "specmesh.services.drafter", "--listen", listen, "--tls-cert", str(pki.service.cert),
                      f"--tls-key={pki.service.key}", "--tls-ca", str(pki.ca)])))
        finally:
            await server.server.stop(0)

    mine, outsider, plaintext, exit_code = asyncio.run(serve_and_probe())
    assert (mine, outsider, plaintext, exit_code) == (True, False, False, 0)


def test_drafters_dialled_by_address_are_checked_against_the_expected_name(tmp_path):
    """Discovery dials pod IPs that certificates do not name: the router expects a name of its choosing."""
    from specmesh.cluster.pki import local_pki
    from specmesh.cluster.tls import channel_options

    named = local_pki(tmp_path / "named", hosts=("drafters.specmesh.test",))  # no IP among its names

    async def main():
        server = await start_server([], "127.0.0.1:0", tls=named, require_client_cert=True)
        address = f"127.0.0.1:{server.port}"
        try:
            results = {}
            for label, options in (("by address", []), ("expecting the name", channel_options("drafters.specmesh.test"))):
                async with grpc.aio.secure_channel(address, named.channel_credentials(), options=options) as channel:
                    try:
                        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                        results[label] = "OK"
                    except grpc.aio.AioRpcError as exc:
                        results[label] = exc.code().name
            return results
        finally:
            await server.server.stop(0)

    assert asyncio.run(main()) == {"by address": "UNAVAILABLE", "expecting the name": "OK"}
