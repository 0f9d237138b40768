"""The verifier service: the target model and the step loop of the requests it takes from the pipeline queue
(``specmesh.cluster.pipeline.engine_worker``), with its drafters; a gRPC control API (Info, Drain) and
Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from functools import partial
from typing import Sequence

from specmesh.cluster.auth import Access, ApiKeys, KeyLimits
from specmesh.cluster.discovery import reach_drafters
from specmesh.cluster.metrics import VerifierMetrics, serve_metrics
from specmesh.cluster.pipeline.messages import ENV_KEY as QUEUE_KEY
from specmesh.cluster.pipeline.messages import QueueKeys, QueueSigner, new_key
from specmesh.cluster.pipeline.verifier_end import QueueMember
from specmesh.cluster.pipeline.engine_worker import EngineWorker
from specmesh.cluster.redis_clients import async_redis
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.serving import Server, Service, TorchThread, run_service, start_server
from specmesh.cluster.service_settings import VerifierSettings
from specmesh.cluster.tls import TlsFiles
from specmesh.drafters.catalog import MODEL_FREE_DRAFTERS
from specmesh.runtime.calibration import measure_pass_curve
from specmesh.runtime.loading import configure_threads, parts_of, pick_device, tokenizer_fingerprint
from specmesh.runtime.target import load_target
from specmesh.runtime.tree_verifier import TreeVerifier
from specmesh.speculation.drafting import LocalDrafter
from specmesh.speculation.policy import adaptive_policy
from specmesh.tree import MAX_TREE_NODES
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger("specmesh.verifier")


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, worker: EngineWorker, info: verifier_pb2.VerifierInfo) -> None:
        self.worker = worker
        self.info = info

    async def Info(self, request, context):
        info = verifier_pb2.VerifierInfo()
        info.CopyFrom(self.info)
        stats = self.worker.verifier.stats
        info.active_sessions = self.worker.verifier.num_sessions
        info.batches, info.jobs = stats.batches, stats.jobs
        info.idle_fraction = stats.idle_fraction()
        info.busy_seconds = stats.busy_s
        info.draining = self.worker.draining
        return info

    async def Drain(self, request, context):
        return verifier_pb2.DrainResponse(released_sessions=await self.worker.drain())


def control_access(signer: QueueSigner, tls: TlsFiles | None) -> Access | None:
    """Who may call the control API (``Drain`` takes the verifier out of service): with mutual TLS the
    cluster's certificate says so; otherwise the cluster's queue key's control token; with neither,
    nobody (health checking stays open)."""
    if tls is not None and tls.ca is not None:
        return None
    token = signer.control_token()
    if token is None:
        log.warning("control API closed: no queue key (%s) and no --tls-ca to tell the cluster's callers by", QUEUE_KEY)
    return Access(ApiKeys(token or new_key()), KeyLimits())


async def follow_worker(worker: EngineWorker, server: Server) -> None:
    """Health tells the truth: a drained verifier, or one whose worker has ended, is NOT_SERVING."""
    await worker.unready.wait()
    await server.set_serving(False)
    if not server.stopping.is_set() and not worker.draining:
        log.error("the worker has stopped: health is NOT_SERVING")


def load_verifier(args: VerifierSettings):
    configure_threads(args.threads)
    if args.tensor_parallel > 1:
        from specmesh.runtime.tensor_parallel import start_group

        target, runtime = start_group(args.model, args.tensor_parallel, args.dtype, args.device,
                                      args.kv_cache_gb or None, args.precision, batch_invariant=args.batch_invariant,
                                      offload=args.offload)
    else:
        target, runtime = load_target(args.model, args.dtype, args.device, args.precision, args.kv_cache_gb or None,
                                      args.batch_invariant, args.offload)
    log.info("target %s computed in %s", target.name, runtime.precision)
    return target, runtime, TreeVerifier(runtime, max_sessions=args.max_sessions, max_tree_nodes=MAX_TREE_NODES)


async def engine_worker(args: VerifierSettings, target, verifier: TreeVerifier, queue: QueueMember,
                        torch_thread: TorchThread, curve, metrics: VerifierMetrics, tls: TlsFiles | None):
    """The engine loop, with its drafters: model-free ones in this process, the others
    over gRPC (mutual TLS with the cluster's CA), found as --discovery says. Returns the worker, its drafter
    set and the task that keeps the set up to date (None: static)."""
    parts = parts_of(target)
    drafters: list = [LocalDrafter(MODEL_FREE_DRAFTERS[name]()) for name in args.local_drafter_names]
    remote, discovery = await reach_drafters(args, queue.redis, drafters, tokenizer_fingerprint(target.tokenizer),
                                             parts.hidden_size or None, parts.num_layers or None, tls)
    policy = adaptive_policy({})  # its routing table and settings then follow the routers' snapshots (policy_sync)
    policy.calibrate([curve])
    worker = EngineWorker(verifier, queue, torch_thread, policy, drafters, frozenset(parts.eos_token_ids), metrics,
                          draft_ahead=args.draft_ahead)
    log.info("the step loop runs here: drafters %s (discovery %s)", ", ".join(d.name for d in drafters) or "none yet",
             args.discovery)
    return worker, remote, discovery


async def serve(args: VerifierSettings) -> None:
    tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)  # first: a bad flag fails before loading
    if tls is not None and tls.ca is None:
        log.warning("TLS without --tls-ca: any caller is answered; give the cluster's CA to require its certificates")
    torch_thread = TorchThread("verify", inline=pick_device(args.device).type == "cpu")
    target, runtime, verifier = await torch_thread.run(load_verifier, args)
    curve = await torch_thread.run(partial(measure_pass_curve, runtime, max_sessions=args.max_sessions))
    log.info("pass curve on %s (requests, rows: ms): %s", curve.device,
             ", ".join(f"{s.requests}, {s.rows}: {s.ms:.1f}" for s in curve.samples))
    longest_ms = max((s.ms for s in curve.samples), default=0.0)
    if torch_thread.inline and longest_ms > args.heartbeat_ttl * 1e3 / 3:  # the loop stands still for a pass
        log.warning("passes of up to %.0f ms on this CPU stop the heartbeat meanwhile: raise --heartbeat-ttl above "
                    "%.1f s so that a long pass is not taken for a death", longest_ms, 3 * longest_ms / 1e3)
    verifier_id = args.verifier_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    redis = async_redis(args.redis_url)
    signer = QueueSigner.from_environment(args.queue_key_file)
    queue = QueueMember(redis, QueueKeys(args.pool), verifier_id, heartbeat_ttl_s=args.heartbeat_ttl,
                          signer=signer, pass_curve=curve)
    metrics = VerifierMetrics()
    endpoint = serve_metrics(metrics, args.metrics_address)
    worker, remote, discovery = await engine_worker(args, target, verifier, queue, torch_thread, curve, metrics, tls)
    info = verifier_pb2.VerifierInfo(
        verifier_id=verifier_id, pool=args.pool, model=target.name, tokenizer_hash=tokenizer_fingerprint(target.tokenizer),
        vocab_size=runtime.vocab_size, max_length=runtime.max_length, max_sessions=args.max_sessions,
        max_batch_tokens=args.max_batch_rows,
    )
    servicer = VerifierServicer(worker, info)

    async def drain() -> None:
        await worker.drain()

    server = await start_server(
        [Service(verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
                 lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), drain)],
        args.listen, metrics=metrics, tls=tls, require_client_cert=tls is not None and tls.ca is not None,
        access=control_access(signer, tls),
    )
    worker_task = asyncio.create_task(worker.run())
    health_task = asyncio.create_task(follow_worker(worker, server))
    log.info("verifier %s (%s) on pool %s, control port %d", verifier_id, target.name, args.pool, server.port)
    metrics_note = f", metrics at {endpoint.url}" if endpoint else ""
    print(f"specmesh-verifier {verifier_id} ready on port {server.port}{metrics_note}", flush=True)
    await server.wait()  # SIGTERM: drains (see drain above), then stops
    worker.stopped.set()
    await worker_task
    health_task.cancel()
    if discovery is not None:
        discovery.cancel()
    await remote.close()
    await asyncio.gather(*(d.close() for d in worker.drafters if isinstance(d, RemoteDrafter)))
    await redis.aclose()
    if endpoint:
        endpoint.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("specmesh-verifier", "Serve the target model for verification.", VerifierSettings, serve,
                       argv)
