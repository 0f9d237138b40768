"""The whole cluster on one machine: Redis, verifiers, drafters and the router, each its own process
started by its command line (as Kubernetes would start it; nothing here imports the services).

A process that dies is started again (``specmesh.cluster.supervisor``): same flags, same port, same
verifier id, so that the others find it where it was and it answers what it held.

Threads are divided so that together the processes never oversubscribe the cores: the verifiers share
the cores, drafters and the router take one thread each (at concurrency 1 drafting and verification
alternate, so the verifier has the cores while it verifies).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from specmesh.cluster.auth import ENV_KEYS
from specmesh.cluster.pki import local_pki
from specmesh.cluster.ports import free_port
from specmesh.cluster.redis_acl import ROLES, acl_line, redis_user
from specmesh.cluster.redis_server import RedisServer
from specmesh.cluster.serving import PARENT_PID
from specmesh.cluster.service_settings import SERVICES, DrafterSettings, RouterSettings, VerifierSettings
from specmesh.cluster.settings import env_name
from specmesh.cluster.pipeline.messages import ENV_KEY as QUEUE_KEY
from specmesh.cluster.pipeline.messages import new_key
from specmesh.cluster.supervisor import UNRESPONSIVE_S, Supervisor
from specmesh.errors import InvalidArgument, Unavailable
from specmesh.runtime.loading import EMBEDDED_DEFAULT, cache_root
from specmesh.speculation.expertise import MODEL_FREE_KINDS

DEFAULT_DRAFTERS = ("ngram", "code", "math", "writing", "knowledge", "chat")

# How long an idle OpenMP thread spins before it sleeps (only the verifiers run more than one thread):
# long enough (~35 ms on 2 cores) to stay awake through a step's drafting, so the next pass starts with a
# warm team. Measurements: docs/experiments/2026-11-23-openmp-spin.md.
OPENMP_SPIN_COUNT = "1000000"


@dataclass
class ClusterSpec:
    model: str = EMBEDDED_DEFAULT
    drafters: Sequence[str] = DEFAULT_DRAFTERS
    verifiers: int = 1
    # The services' settings (specmesh.cluster.service_settings); None: the service's own default
    max_tree_nodes: int | None = None  # the router's
    speculation: str | None = None  # the router's default for requests: adaptive, fixed or off
    speculation_margin: float | None = None  # adaptive's margin in a shared pass (the router's)
    job_timeout_s: float | None = None  # the router's
    dtype: str | None = None  # the verifiers'
    device: str | None = None  # the verifiers' (None: CUDA when present)
    precision: str | None = None  # the verifiers' (see specmesh.runtime.precision.PRECISIONS)
    kv_cache_gb: float | None = None  # each verifier's KV cache budget
    batch_invariant: bool | None = None  # the verifiers' matrix products (CUDA; see PagedLlamaRuntime)
    offload: bool = False  # the verifiers' decoder layers in host memory, streamed to the device (offload.py)
    tensor_parallel: int | None = None  # processes each verifier's target is split over (tensor_parallel.py)
    routers: int = 1  # router processes; all serve the whole cluster (clients fail over between them)
    router_port: int = 0  # the first router's (0: a free port; the others always take free ones)
    http_port: int | None = 0  # the router's OpenAI-compatible HTTP API (0: a free port; None: not served)
    api_keys_file: Path | None = None  # the router's API keys (besides $SPECMESH_API_KEYS; none: no authentication)
    api_keys: tuple[str, ...] = ()  # more keys, given to the router only (the first is the local clients')
    tls: bool = False  # a CA of the cluster's own: TLS on the router's ports, mutual TLS inside
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    log_dir: Path | None = None  # None: a temporary directory, removed by ``stop(clean=True)``
    supervise: bool = True  # start again what dies (see specmesh.cluster.supervisor)
    unresponsive_s: float = UNRESPONSIVE_S  # and kill, then start again, what has stopped serving this long
    redis_url: str | None = None  # a Redis of the caller's (not started, stopped or supervised here)
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.router_flags()  # a bad setting fails here, not once the cluster is half up
        self.verifier_flags()
        if self.routers < 1:
            raise InvalidArgument("routers", f"must be >= 1, got {self.routers}")
        if not self.unresponsive_s > 0:
            raise InvalidArgument("unresponsive_s", f"must be > 0, got {self.unresponsive_s}")

    def router_flags(self) -> list[str]:
        """Every router's flags from this spec (checked as the router checks them)."""
        return RouterSettings.command_line(
            model=self.model, max_tree_nodes=self.max_tree_nodes,
            speculation=self.speculation, speculation_margin=self.speculation_margin, job_timeout=self.job_timeout_s,
            api_keys_file=None if self.api_keys_file is None else str(self.api_keys_file))

    def verifier_flags(self) -> list[str]:
        """Every verifier's flags from this spec."""
        return VerifierSettings.command_line(model=self.model, dtype=self.dtype, device=self.device,
                                             precision=self.precision, kv_cache_gb=self.kv_cache_gb,
                                             batch_invariant=self.batch_invariant, offload=self.offload or None,
                                             tensor_parallel=self.tensor_parallel)


@dataclass
class ServiceProcess:
    name: str
    command: list[str]
    port: int
    log_path: Path
    env: dict[str, str]
    metrics_port: int = 0  # where its Prometheus metrics are served (0: not served)
    popen: subprocess.Popen | None = None
    credentials: grpc.ChannelCredentials | None = None  # to reach it when it serves TLS
    _channel: grpc.Channel | None = field(default=None, repr=False)  # the supervisor's health checks

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else ""

    def metrics(self) -> list[Metric]:
        """Its Prometheus metrics as it serves them now, parsed (none where it serves none)."""
        if not self.metrics_url:
            return []
        with urllib.request.urlopen(self.metrics_url, timeout=5) as answer:
            return list(text_string_to_metric_families(answer.read().decode()))

    def start(self) -> None:
        log = open(self.log_path, "ab")
        # a session of its own: a terminal's Ctrl-C reaches the launcher only, which drains them in order (the
        # service ends with the launcher by itself: serving.die_with_parent, which also sees a launcher that
        # ended while it imported)
        self.popen = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def channel(self) -> grpc.Channel:
        return (grpc.secure_channel(self.address, self.credentials) if self.credentials is not None
                else grpc.insecure_channel(self.address))

    def serving(self, timeout_s: float = 1.0) -> bool | None:
        """What its gRPC health check (the server's own, "") says now: a drained verifier says NOT_SERVING
        (False); one starting or hung does not answer (None). A router without verifiers stays SERVING here."""
        if self._channel is None:
            self._channel = self.channel()
        try:
            answer = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s) if self.popen else None
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until its gRPC health check says SERVING; fails early if the process dies."""
        deadline = time.monotonic() + timeout_s
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if not self.alive():
                    raise Unavailable(f"{self.name} exited during start-up:\n{self.log_tail()}")
                try:
                    answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise Unavailable(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")


REDIS_URL = env_name("redis_url")  # every service's --redis-url


class LocalCluster:
    def __init__(self, spec: ClusterSpec | None = None) -> None:
        self.spec = spec or ClusterSpec()
        self.temporary = self.spec.log_dir is None
        self.keep_logs = False  # set after a failure: a temporary log directory stays, for its logs
        self.log_dir = Path(self.spec.log_dir or tempfile.mkdtemp(prefix="specmesh-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # the Redis started here asks for passwords of this cluster's own (any local process could otherwise
        # read and write the queue, or flush it), one user per role with only the commands it needs
        self.redis_passwords = {role: new_key() for role in ROLES}
        self.redis = None if self.spec.redis_url else RedisServer(
            log_path=self.log_dir / "redis.log", password=new_key(),
            users=[acl_line(role, redis_user(role), password) for role, password in self.redis_passwords.items()])
        self.redis_url = self.spec.redis_url or self.redis.url  # the operator's: every right
        self.verifiers: list[ServiceProcess] = []
        self.drafters: list[ServiceProcess] = []
        self.routers: list[ServiceProcess] = []
        self.supervisor: Supervisor | None = None
        self.events: list[str] = []  # what the supervisor did, in order
        self.http_urls: list[str] = []  # each router's OpenAI API, once started (empty: not served)
        # the router and verifiers tag their queue entries with a key of this cluster's own
        self.queue_key = os.environ.get(QUEUE_KEY) or new_key()
        self.tls = local_pki(self.log_dir / "pki") if self.spec.tls else None

    @property
    def router(self) -> ServiceProcess | None:
        """The first router."""
        return self.routers[0] if self.routers else None

    @property
    def router_address(self) -> str:
        return self.router.address

    @property
    def router_addresses(self) -> list[str]:
        """Every router's, for a client that fails over between them."""
        return [r.address for r in self.routers]

    @property
    def http_url(self) -> str:
        """The first router's OpenAI API (empty: not served)."""
        return self.http_urls[0] if self.http_urls else ""

    @property
    def redis_url_file(self) -> Path:
        return self.log_dir / "redis-url"

    @property
    def client_tls_ca(self) -> str | None:
        """The CA a client of this cluster's router trusts (None: the router serves plaintext)."""
        return str(self.tls.ca) if self.tls is not None else None

    @property
    def client_key(self) -> str | None:
        """The API key this machine's own clients (the demo) send: the spec's first, $SPECMESH_API_KEY, else
        the first key of $SPECMESH_API_KEYS (None: the router needs none, or only hashes are known here)."""
        if self.spec.api_keys:
            return self.spec.api_keys[0]
        explicit = os.environ.get("SPECMESH_API_KEY")
        listed = [k.strip() for k in os.environ.get(ENV_KEYS, "").split(",") if k.strip()]
        return explicit or (listed[0] if listed and not listed[0].startswith("sha256:") else None)

    def _env(self, threads: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
                    "MKL_NUM_THREADS": str(threads), "GOMP_SPINCOUNT": OPENMP_SPIN_COUNT})
        env[QUEUE_KEY] = self.queue_key
        env[REDIS_URL] = self.redis_url  # not a flag: a command line is anyone's to read, and it holds the password
        env[PARENT_PID] = str(os.getpid())  # the services end themselves if the launcher is killed
        # compiled kernels are kept with the converted models, not in a temporary folder: a restart reuses them
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        env.update(self.spec.extra_env)
        return env

    def _service(self, name: str, module: str, args: list[str], threads: int, port: int = 0) -> ServiceProcess:
        port, metrics_port = port or free_port(), free_port()
        tls = {} if self.tls is None else {"tls_cert": str(self.tls.cert), "tls_key": str(self.tls.key),
                                           "tls_ca": str(self.tls.ca)}
        command = [sys.executable, "-m", f"specmesh.services.{module}", *args,
                   *SERVICES[module].command_line(listen=f"127.0.0.1:{port}",
                                                  metrics_address=f"127.0.0.1:{metrics_port}", **tls)]
        env = self._env(threads)
        credentials = self.tls.channel_credentials() if self.tls is not None else None
        if self.redis is not None:  # the service's own user
            env[REDIS_URL] = self.redis.url_for(redis_user(module), self.redis_passwords[module])
        if module == "router" and self.spec.api_keys:
            env[ENV_KEYS] = ",".join([*filter(None, [env.get(ENV_KEYS)]), *self.spec.api_keys])
        return ServiceProcess(name, command, port, self.log_dir / f"{name}.log", env, metrics_port,
                              credentials=credentials)

    def verifier_process(self, index: int) -> ServiceProcess:
        threads = max(1, self.spec.cores // max(1, self.spec.verifiers))
        args = [*self.spec.verifier_flags(),
                *VerifierSettings.command_line(threads=threads, verifier_id=f"verifier-{index}",
                                               drafters=",".join(d.address for d in self.drafters),
                                               local_drafters=",".join(self.local_drafters))]
        return self._service(f"verifier-{index}", "verifier", args, threads)

    def drafter_process(self, drafter: str) -> ServiceProcess:
        args = DrafterSettings.command_line(drafter=drafter, model=self.spec.model, threads=1)
        return self._service(f"drafter-{Path(drafter).name}", "drafter", args, 1)

    def router_process(self, index: int) -> ServiceProcess:
        """Router ``index``, calling the drafter services started (``self.drafters``); the first on the spec's
        ports, the others on free ones."""
        spec = self.spec
        http_port = None if spec.http_port is None else (spec.http_port if index == 0 else 0) or free_port()
        if http_port is not None:
            self.http_urls.append(f"{'https' if self.tls is not None else 'http'}://127.0.0.1:{http_port}/v1")
        args = [*spec.router_flags(), *RouterSettings.command_line(
            drafters=",".join(d.address for d in self.drafters), local_drafters=",".join(self.local_drafters),
            http_listen="" if http_port is None else f"127.0.0.1:{http_port}")]
        name = "router" if index == 0 else f"router-{index}"
        return self._service(name, "router", args, 1, spec.router_port if index == 0 else 0)

    @property
    def local_drafters(self) -> list[str]:
        """Model-free drafters need only the tokens the router holds: they run inside it, no network hop."""
        return [d for d in self.spec.drafters if d in MODEL_FREE_KINDS]

    def start(self, timeout_s: float = 600.0) -> LocalCluster:
        spec = self.spec
        try:
            if self.redis is not None:
                self.redis.start()
                # for the operator's own clients (redis-cli -u "$(cat ...)"): readable by this user only
                handle = os.open(self.redis_url_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.fchmod(handle, 0o600)
                with os.fdopen(handle, "w") as out:
                    out.write(self.redis_url + "\n")
            self.drafters = [self.drafter_process(d) for d in spec.drafters if d not in self.local_drafters]
            self.verifiers = [self.verifier_process(i) for i in range(spec.verifiers)]
            for process in [*self.verifiers, *self.drafters]:
                process.start()
            for process in [*self.verifiers, *self.drafters]:
                process.wait_ready(timeout_s)
            self.routers = [self.router_process(index) for index in range(spec.routers)]
            for router in self.routers:
                router.start()
            for router in self.routers:
                router.wait_ready(timeout_s)
        except BaseException:
            self.stop(clean=False)
            raise
        if spec.supervise:
            self.supervisor = Supervisor(lambda: [*filter(None, [self.redis]), *self.processes()], self._essential,
                                         self._report, unresponsive_s=spec.unresponsive_s).start()
        return self

    def _essential(self, part) -> bool:
        """Whether the cluster can serve without ``part`` (it crash-loops)."""
        if part in self.verifiers:
            return all(self.supervisor.given_up(v.name) for v in self.verifiers)
        if part in self.routers:
            return all(self.supervisor.given_up(r.name) for r in self.routers)
        return part is self.redis

    def _report(self, message: str) -> None:
        self.events.append(message)
        print(f"specmesh: {message}", flush=True)

    def processes(self) -> list[ServiceProcess]:
        return [*self.routers, *self.drafters, *self.verifiers]

    def stop(self, grace_s: float = 15.0, clean: bool = True) -> None:
        """SIGTERM (graceful: each drains) from the router down, then SIGKILL what is left. ``clean``: a
        temporary log directory goes too (kept after a failure, for its logs)."""
        if self.supervisor is not None:
            self.supervisor.hold()
        for process in self.processes():
            process.signal(signal.SIGCONT)  # a stopped process cannot drain
            process.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes():
            if process.wait(max(0.0, deadline - time.monotonic())) is None:
                process.signal(signal.SIGKILL)
                process.wait(5)
        if self.supervisor is not None:
            self.supervisor.stop()
        for process in self.processes():
            process.close()
        if self.redis is not None:
            self.redis.stop()
        if clean and self.temporary and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, kind, value, traceback) -> None:
        self.stop(clean=kind is None or issubclass(kind, KeyboardInterrupt))
