"""The router's command line: its flags, each with its environment variable."""

from __future__ import annotations

import argparse

from specmesh.cluster.discovery import DEFAULT_SELECTOR, DISCOVERY_MODES
from specmesh.cluster.serving import env_default
from specmesh.cluster.tls import add_tls_flags
from specmesh.drafters.catalog import MODEL_FREE_DRAFTERS
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import EMBEDDED_DEFAULT
from specmesh.services.router.openai_api import DEFAULT_MAX_BODY_BYTES
from specmesh.speculation.policy import DEFAULT_TREE_NODES, SPECULATION_MARGIN, SPECULATION_MODES


def local_drafter_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODEL_FREE_DRAFTERS]
    if unknown:
        raise InvalidArgument("local_drafters", f"{', '.join(unknown)} cannot run in the router; model-free drafters: "
                                                f"{', '.join(MODEL_FREE_DRAFTERS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh-router", description="Serve the client API of a specmesh cluster.")
    parser.add_argument("--model", default=env_default("model", EMBEDDED_DEFAULT),
                        help="the target (its tokenizer and config are read; no weights) [SPECMESH_MODEL]")
    parser.add_argument("--redis-url", default=env_default("redis_url", "redis://127.0.0.1:6379/0"), help="[SPECMESH_REDIS_URL]")
    parser.add_argument("--pool", default=env_default("pool", "default"), help="verifier pool [SPECMESH_POOL]")
    parser.add_argument("--drafters", default=env_default("drafters", ""),
                        help="comma-separated drafter addresses host:port [SPECMESH_DRAFTERS]")
    parser.add_argument("--discovery", choices=DISCOVERY_MODES, default=env_default("discovery", "static"),
                        help="how drafters are found: static (--drafters), redis (drafters announce themselves in "
                             "the registry) or kubernetes (EndpointSlices of labelled Services) [SPECMESH_DISCOVERY]")
    parser.add_argument("--discovery-selector", default=env_default("discovery_selector", DEFAULT_SELECTOR),
                        help=f"kubernetes: label selector of the drafter Services (default {DEFAULT_SELECTOR}) "
                             "[SPECMESH_DISCOVERY_SELECTOR]")
    parser.add_argument("--namespace", default=env_default("namespace"),
                        help="kubernetes: namespace of the drafter Services (default: the router pod's) [SPECMESH_NAMESPACE]")
    parser.add_argument("--local-drafters", default=env_default("local_drafters", ""),
                        help="model-free drafters to run inside the router, comma-separated: ngram (prompt "
                             "lookup), history; they need only the tokens the router holds, so no network hop "
                             "[SPECMESH_LOCAL_DRAFTERS]")
    parser.add_argument("--listen", default=env_default("listen", "127.0.0.1:50051"), help="host:port [SPECMESH_LISTEN]")
    parser.add_argument("--http-listen", default=env_default("http_listen", "127.0.0.1:8000"),
                        help="host:port of the OpenAI-compatible HTTP API (/v1/chat/completions, ...); empty: off "
                             "[SPECMESH_HTTP_LISTEN]")
    parser.add_argument("--http-max-body", type=int, default=int(env_default("http_max_body", str(DEFAULT_MAX_BODY_BYTES))),
                        help="largest HTTP request body in bytes (larger: 413) [SPECMESH_HTTP_MAX_BODY]")
    parser.add_argument("--api-keys-file", default=env_default("api_keys_file"),
                        help="API keys, one a line (or sha256:<hex>), each optionally followed by a name; read again "
                             "when it changes. With SPECMESH_API_KEYS (comma-separated) the keys callers must send as "
                             "'authorization: Bearer <key>'. No key: loopback only, no authentication "
                             "[SPECMESH_API_KEYS_FILE]")
    parser.add_argument("--key-max-concurrent", type=int, default=int(env_default("key_max_concurrent", "0")),
                        help="calls in flight per API key (default 0: only --max-concurrent) [SPECMESH_KEY_MAX_CONCURRENT]")
    parser.add_argument("--key-requests-per-minute", type=int,
                        default=int(env_default("key_requests_per_minute", "0")),
                        help="calls a minute per API key (default 0: no limit) [SPECMESH_KEY_REQUESTS_PER_MINUTE]")
    parser.add_argument("--queue-key-file", default=env_default("queue_key_file"),
                        help="the key shared with the verifiers: jobs are tagged with it, only results tagged with "
                             "it are taken (else $SPECMESH_QUEUE_KEY; neither: untagged) [SPECMESH_QUEUE_KEY_FILE]")
    parser.add_argument("--metrics-address", default=env_default("metrics_address", "127.0.0.1:9400"),
                        help="serve Prometheus metrics at http://ADDRESS/metrics ('' = off) [SPECMESH_METRICS_ADDRESS]")
    parser.add_argument("--max-concurrent", type=int, default=int(env_default("max_concurrent", "64")))
    parser.add_argument("--max-queue-backlog", type=int, default=int(env_default("max_queue_backlog", "256")))
    parser.add_argument("--max-tree-nodes", type=int, default=int(env_default("max_tree_nodes", str(DEFAULT_TREE_NODES))))
    parser.add_argument("--default-max-tokens", type=int, default=int(env_default("default_max_tokens", "256")))
    parser.add_argument("--draft-ahead", choices=("on", "off"), default=env_default("draft_ahead", "on"),
                        help="draft the next tree while the current one is verified (default on)")
    parser.add_argument("--speculation", choices=SPECULATION_MODES, default=env_default("speculation", "adaptive"),
                        help="for requests that do not choose: adaptive (routed drafters, budget by goodput), fixed "
                             "(routed drafters, the whole budget) or off [SPECMESH_SPECULATION]")
    parser.add_argument("--speculation-margin", type=float,
                        default=float(env_default("speculation_margin", str(SPECULATION_MARGIN))),
                        help="adaptive: in a shared pass, the least predicted goodput gain a tree must promise, in "
                             "shares of one request's part of the batch's goodput (default "
                             f"{SPECULATION_MARGIN}) [SPECMESH_SPECULATION_MARGIN]")
    parser.add_argument("--max-drafters", type=int, default=int(env_default("max_drafters", "1")),
                        help="model drafters asked per step, the best for the request, besides the model-free ones "
                             "(default 1) [SPECMESH_MAX_DRAFTERS]")
    parser.add_argument("--explore", type=float, default=float(env_default("explore", "0.1")),
                        help="chance per step of also asking a drafter outside the best (default 0.1) [SPECMESH_EXPLORE]")
    parser.add_argument("--job-timeout", type=float, default=float(env_default("job_timeout", "30")),
                        help="seconds a verification step may take before the request fails UNAVAILABLE (a long "
                             "prefill counts from its verifier's last progress report)")
    parser.add_argument("--drafter-timeout", type=float, default=float(env_default("drafter_timeout", "2")),
                        help="deadline of each drafter call, seconds")
    add_tls_flags(parser, env_default)  # TLS on both client APIs; with --tls-ca, mutual TLS to the drafters
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"))
    return parser
