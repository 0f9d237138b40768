"""What each service takes: the router's, the verifier's and the drafter's settings, each declared once
(``specmesh.cluster.settings``): their flags, ``SPECMESH_*`` variables, the launcher's command lines and
the flags tables of docs/operations.md all come from these fields. It imports no service machinery (every
`specmesh` command reads it); the machinery takes its defaults from here."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from specmesh.cluster.drafter_sessions import DEFAULT_IDLE_S, DEFAULT_TOTAL_TOKENS
from specmesh.cluster.settings import Settings, setting
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import EMBEDDED_DEFAULT
from specmesh.runtime.precision import PRECISIONS
from specmesh.runtime.tree_verifier import MAX_SESSIONS
from specmesh.speculation.expertise import MODEL_FREE_KINDS, RoutingConfig
from specmesh.speculation.policy import DEFAULT_TREE_NODES, SPECULATION_MARGIN, SPECULATION_MODES
from specmesh.tree import MAX_TREE_NODES

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 4 MiB request is ~1M tokens of text: far past any context
DISCOVERY_MODES = ("static", "redis", "kubernetes")
DEFAULT_SELECTOR = "specmesh.io/role=drafter"  # the drafter Services' label (kubernetes discovery)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ServiceSettings(Settings):
    """What every service takes: its target, the queue, TLS and logging."""

    model: str = setting(EMBEDDED_DEFAULT, "the target: a hub id, a model directory, a .gguf file, or "
                         "random:<architecture> (real shapes, random weights: for measuring speed)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "the pipeline queue's Redis (a password goes in the URL; "
                             "`specmesh up` passes it in the environment, never on a command line)")
    tls_cert: str | None = setting(None, "this service's certificate (PEM); with --tls-key: serve TLS")
    tls_key: str | None = setting(None, "its private key (PEM)")
    tls_ca: str | None = setting(None, "the cluster's CA (PEM): peers must present a certificate it signed "
                                 "(drafters and verifiers then require client certificates: mutual TLS)")
    log_level: Literal[LOG_LEVELS] = setting("INFO", "logging level")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value):
        return value.upper() if isinstance(value, str) else value


class DrafterClientSettings(ServiceSettings):
    """What a service that knows the drafters takes (the verifiers, whose step loops draft; the routers, which
    route by them): where the drafters are and how they are called."""

    drafters: str = setting("", "drafter addresses host:port, comma-separated (static discovery; the Helm chart "
                            "always sets them)")
    discovery: Literal[DISCOVERY_MODES] = setting("static", "how drafters are found: static (--drafters), redis "
                                                  "(drafters announce themselves in the registry) or kubernetes "
                                                  "(EndpointSlices of labelled Services)")
    discovery_selector: str = setting(DEFAULT_SELECTOR, "kubernetes: label selector of the drafter Services")
    namespace: str | None = setting(None, "kubernetes: namespace of the drafter Services", shown="the pod's")
    local_drafters: str = setting("", "model-free drafters run inside this service, comma-separated: ngram (prompt "
                                  "lookup), history; they need only the tokens it holds, so no network hop")
    drafter_timeout: float = setting(2.0, "deadline of each drafter call, seconds", gt=0)
    tls_server_name: str | None = setting(None, "with --tls-ca: the name the drafters have in their certificates, "
                                          "as they are dialled by address (discovered pod IPs)")

    @field_validator("local_drafters")
    @classmethod
    def _model_free(cls, value: str) -> str:
        unknown = [n for n in _names(value) if n not in MODEL_FREE_KINDS]
        if unknown:
            raise ValueError(f"{', '.join(unknown)} cannot run inside a service; model-free drafters: "
                             f"{', '.join(MODEL_FREE_KINDS)}")
        return value

    @property
    def local_drafter_names(self) -> list[str]:
        return _names(self.local_drafters)

    @property
    def drafter_addresses(self) -> list[str]:
        return _names(self.drafters)


class RouterSettings(DrafterClientSettings):
    model: str = setting(EMBEDDED_DEFAULT, "the target: only its tokenizer and config are read, not its weights")
    pool: str = setting("default", "the verifier pool to admit requests to (one Redis stream)")
    listen: str = setting("127.0.0.1:50051", "gRPC address, host:port")
    http_listen: str = setting("127.0.0.1:8000", "OpenAI-compatible HTTP API (/v1/chat/completions, ...; "
                               "docs/openai-api.md), host:port; empty: off")
    metrics_address: str = setting("127.0.0.1:9400", "serve Prometheus metrics at http://ADDRESS/metrics; empty: off")
    http_max_body: int = setting(DEFAULT_MAX_BODY_BYTES, "largest HTTP request body in bytes (larger: 413)", gt=0)
    api_keys_file: str | None = setting(None, "API keys callers must send as 'authorization: Bearer <key>', one a "
                                        "line (or sha256:<hex>), each optionally followed by a name, read again when "
                                        "it changes; with $SPECMESH_API_KEYS (comma-separated). No key: loopback "
                                        "only, no authentication (docs/security.md)")
    key_max_concurrent: int = setting(0, "calls in flight per API key (0: only --max-concurrent)", ge=0)
    key_requests_per_minute: int = setting(0, "calls a minute per API key (0: no limit)", ge=0)
    queue_key_file: str | None = setting(None, "the queue's HMAC key shared with the verifiers: admissions and aborts "
                                         "are tagged with it, only outputs tagged with it are taken (else "
                                         "$SPECMESH_QUEUE_KEY; neither: untagged)")
    max_concurrent: int = setting(64, "requests in flight; more get RESOURCE_EXHAUSTED", gt=0)
    max_queue_backlog: int = setting(256, "admitted requests no verifier has taken yet; beyond it new "
                                     "requests get RESOURCE_EXHAUSTED", gt=0)
    max_tree_nodes: int = setting(DEFAULT_TREE_NODES, "cap on a step's tree (adaptive drafts fewer where they do not "
                                  f"pay); a request may ask less (0-{MAX_TREE_NODES}), never more; 0: no "
                                  "speculation", ge=0, le=MAX_TREE_NODES)
    default_max_tokens: int = setting(256, "for requests that give no max_tokens", gt=0)
    speculation: Literal[SPECULATION_MODES] = setting(
        "adaptive", "adaptive (drafters routed by the request's kind, the budget chosen each step by goodput), fixed "
        "(routed drafters, the whole budget every step) or off (plain decoding); the router's is for requests that "
        "do not choose")
    speculation_margin: float = setting(
        SPECULATION_MARGIN, "adaptive, in a shared pass: the least predicted gain in the batch's goodput a tree must "
        "promise, in shares of one request's part of it (0.3: the request itself predicted 30 % faster)", ge=0)
    max_drafters: int = setting(RoutingConfig.max_drafters, "model drafters asked per step, the best for the request, besides the model-free "
                                "ones", ge=1)
    explore: float = setting(RoutingConfig.explore, "chance per step of also asking a drafter outside the best", ge=0, le=1)
    job_timeout: float = setting(30.0, "seconds a request may hear nothing from the verifiers before it fails "
                                 "UNAVAILABLE, unless its admission still waits in the queue (a verifier restarting)", gt=0)


class VerifierSettings(DrafterClientSettings):
    pool: str = setting("default", "the verifier pool it serves (one Redis stream of admissions)")
    listen: str = setting("127.0.0.1:50071", "control API (health, Info, Drain), host:port")
    metrics_address: str = setting("127.0.0.1:9401", "serve Prometheus metrics at http://ADDRESS/metrics; empty: off")
    verifier_id: str | None = setting(None, "its Redis consumer name and commit log (the chart uses the "
                                      "StatefulSet pod's name)", shown="host-pid-random")
    threads: int | None = setting(None, "torch threads", shown="all cores", ge=1)
    max_sessions: int = setting(MAX_SESSIONS, "KV sessions held (requests whose cache it keeps)", gt=0)
    max_batch_rows: int = setting(2048, "rows (roots, tree nodes, prefill) a pass may take (fewer where the pass "
                                  "curve says they take over 250 ms)", gt=0)
    heartbeat_ttl: float = setting(3.0, "seconds its heartbeat key lives without renewal (then the others adopt "
                                   "its requests)", gt=0)
    device: str | None = setting(None, "where the target runs: cpu, cuda, cuda:N", shown="CUDA when present")
    dtype: str | None = setting(None, "float32, bfloat16 or float16", shown="fp32 on CPU, bf16 on CUDA")
    precision: Literal[PRECISIONS] = setting(
        "shipped", "shipped: a GGUF target on a CPU computes on its own Q4_0/Q4_1/Q8_0 blocks (the C++ kernels, "
        "built at install; without a compiler it logs why and runs de-quantized); fp32: on the de-quantized "
        "weights, token for token Hugging Face's output; q8_0: any Llama-family model's projections rounded to "
        "8-bit blocks at load")
    kv_cache_gb: float = setting(0.0, "the target's KV cache in GiB, every request's in one budget (on CUDA a paged "
                                 "pool); a request that does not fit gets RESOURCE_EXHAUSTED. 0: half the GPU memory "
                                 "free after loading, a quarter of the machine's memory on CPU", ge=0)
    batch_invariant: bool | None = setting(
        None, "CUDA: matrix products in Triton whose reduction is fixed by the weights, so that a request's logits "
        "never depend on the batch it is verified in; --no-batch-invariant puts cuBLAS under them (faster for large "
        "batches, exact only within a row bucket). CPU targets on their shipped blocks are batch-invariant always",
        shown="on for CUDA")
    offload: bool = setting(False, "keep the target's decoder layers in host memory and stream them to the device a "
                            "layer at a time (targets larger than the device's memory; a pass then costs about the "
                            "same for a thousand rows as for one; no CUDA graphs, no GGUF blocks; with "
                            "tensor_parallel each rank streams its share)")
    draft_ahead: Literal["auto", "on", "off"] = setting(
        "auto", "draft each request's next tree while the pass verifies this one, assuming its likeliest path "
        "(used when the verdict confirms it): on, off, or auto: with drafters on other machines (on this one's "
        "cores, drafting takes them from the pass)")
    tensor_parallel: int = setting(1, "processes the target is split over (tensor parallelism: each holds 1/N of "
                                   "every layer and its KV cache; a GPU each over NCCL, or sharing GPUs or a CPU over "
                                   "gloo); they fail and "
                                   "start again as one", ge=1)
    queue_key_file: str | None = setting(None, "the queue's HMAC key shared with the routers: only admissions tagged "
                                         "with it run, outputs are tagged with it (else $SPECMESH_QUEUE_KEY; "
                                         "neither: untagged)")


class DrafterSettings(ServiceSettings):
    renamed = {"target": "model"}
    model: str = setting(EMBEDDED_DEFAULT, "the target drafted for: its tokenizer and input embeddings are read, "
                         "not its weights")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "the registry for --announce")
    drafter: str = setting("ngram", "ngram, history, a shipped expert (code, math, writing, knowledge, chat), a "
                           "`specmesh distill` directory, or a small HF model sharing the target's tokenizer")
    domains: str | None = setting(None, "domains it advertises to routers, comma-separated",
                                  shown="the expert's own, else general")
    listen: str = setting("127.0.0.1:50061", "gRPC address, host:port")
    metrics_address: str = setting("127.0.0.1:9402", "serve Prometheus metrics at http://ADDRESS/metrics; empty: off")
    announce: str | None = setting(None, "host:port at which routers reach it: announced in the Redis registry for "
                                   "routers with --discovery redis")
    threads: int = setting(1, "torch threads", ge=1)
    max_sessions: int = setting(1024, "requests it keeps state for; past that the least recently used is ended (the "
                                "router re-opens it on NOT_FOUND)", gt=0)
    session_idle_s: float = setting(DEFAULT_IDLE_S, "a session unused this long ends (its router is most likely "
                                    "gone; a live one is re-opened on NOT_FOUND)", gt=0)
    max_held_tokens: int = setting(DEFAULT_TOTAL_TOKENS, "tokens all sessions may hold together; past it the least "
                              "recently used end (each holds at most the target's context)", gt=0)
    device: str | None = setting(None, "where it drafts: cpu, cuda, cuda:N or auto",
                                 shown="an expert on the CPU, a model on CUDA when present")
    dtype: str | None = setting(None, "float32, bfloat16 or float16", shown="the drafter's own")

    @property
    def domain_names(self) -> list[str]:
        return _names(self.domains or "")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


SERVICES = {"router": RouterSettings, "verifier": VerifierSettings, "drafter": DrafterSettings}


def with_flags_tables(markdown: str) -> str:
    """``markdown`` with each ``<!-- flags:SERVICE -->`` ... ``<!-- /flags:SERVICE -->`` block rewritten
    from that service's settings (docs/operations.md; ``make docs`` runs it)."""
    for name, settings in SERVICES.items():
        start, end = f"<!-- flags:{name} -->\n", f"<!-- /flags:{name} -->"
        head, found, rest = markdown.partition(start)
        if not found:
            raise InvalidArgument("markdown", f"no {start.strip()} block")
        _, found, tail = rest.partition(end)
        if not found:
            raise InvalidArgument("markdown", f"{start.strip()} is not closed by {end}")
        markdown = f"{head}{start}{settings.flags_table()}{end}{tail}"
    return markdown


if __name__ == "__main__":  # make docs: rewrite the flags tables of the files named
    import sys

    for path in sys.argv[1:]:
        with open(path) as source:
            text = source.read()
        with open(path, "w") as out:
            out.write(with_flags_tables(text))
