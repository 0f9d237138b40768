"""The ``specmesh`` command line: generate, up, bench, distill, prepare."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

from specmesh.errors import InvalidArgument, SpecmeshError
from specmesh.runtime.random_models import is_random
from specmesh.cluster.service_settings import RouterSettings, VerifierSettings
from specmesh.speculation.policy import DEFAULT_FIXED_TREE_NODES

DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome, and explain it."
# grounded: the answer rewrites text the prompt holds, where prompt lookup's guesses are right
GROUNDED_DEMO_PROMPT = (
    "Fix the spelling mistakes in this paragraph and return the whole paragraph:\n\n"
    "The libary opens at nine in the morning and closes at six in the evening. Vistors can borrow up to "
    "five books at a time, and each book can be kept for three weeks. Late returns are charged a small fee, "
    "and lost books must be replaced or paid for. The reading room on the second floor is quiet, and "
    "children are welcome in the story corner every Saturday morning."
)
# what `specmesh up` passes on to its routers and verifiers
UP_ROUTER_SETTINGS = ("api_keys_file", "max_tree_nodes", "speculation", "speculation_margin")
UP_VERIFIER_SETTINGS = ("precision", "kv_cache_gb", "batch_invariant", "offload", "tensor_parallel")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The target and drafters of a command that runs them in this process."""
    VerifierSettings.add_flags(parser, ["model"], defaults=True, environment=False)
    parser.add_argument("--drafter", action="append", default=None,
                        help="drafter: ngram (prompt lookup), history, a shipped expert (code, math, writing, knowledge, "
                        "chat), a drafter directory, or a small model sharing the target's tokenizer; repeatable "
                        "(default: ngram)")
    RouterSettings.add_flags(parser, ["max_tree_nodes"], defaults=True, environment=False)
    VerifierSettings.add_flags(parser, ["device", "dtype", "precision", "threads", "kv_cache_gb", "batch_invariant"],
                               defaults=True, environment=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)
    _add_up(commands)
    _add_bench(commands)
    _add_tune(commands)
    _add_distill(commands)
    _add_drafters(commands)
    _add_prepare(commands)
    _add_redis_acl(commands)
    _add_verifier(commands)
    return parser


def _add_generate(commands) -> None:
    """The ``generate`` command: text for a prompt, in process or through a cluster."""
    gen = commands.add_parser("generate", help="generate text for a prompt or a JSONL file of prompts")
    gen.add_argument("prompt", nargs="?", help="the user message (chat template applied)")
    gen.add_argument("--prompts", help="JSONL file: one {'prompt': ..., 'category': ...} a line")
    _add_model_args(gen)
    VerifierSettings.add_flags(gen, ["offload"], defaults=True, environment=False)
    gen.add_argument("--greedy", action="store_true", help="greedy decoding (the default unless --temperature > 0)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    RouterSettings.add_flags(gen, ["speculation"], environment=False)  # with --server: none, the router's
    gen.add_argument("--compare-plain", action="store_true",
                     help="also decode without speculation; report identity and the speed ratio")
    gen.add_argument("--server", metavar="HOST:PORT[,HOST:PORT...]",
                     help="go through a running cluster's router (see `specmesh up`) instead of loading models here")
    gen.add_argument("--api-key", default=None,
                     help="with --server: the router's API key (default: $SPECMESH_API_KEY)")
    gen.add_argument("--tls-ca", default=None, metavar="PEM",
                     help="with --server: connect over TLS, trusting this CA (\"\": the system's roots)")


def _add_up(commands) -> None:
    """The ``up`` command: the whole cluster on this machine, with a demo."""
    up = commands.add_parser("up", help="run the whole cluster on this machine, with a demo request")
    VerifierSettings.add_flags(up, ["model"], defaults=True, environment=False)
    up.add_argument("--drafter", action="append", default=None,
                    help="a drafter service to start (ngram, history, code, math, writing, knowledge, chat, a directory, a model); "
                    "repeatable (default: ngram and every shipped expert)")
    up.add_argument("--verifiers", type=int, default=1, help="verifier processes (default 1)")
    up.add_argument("--routers", type=int, default=1,
                    help="router processes (default 1); clients given all their addresses fail over between them")
    up.add_argument("--port", type=int, default=50051, help="the router's gRPC port (default 50051; 0 = any free)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="the router's OpenAI-compatible HTTP API (default 8000: http://127.0.0.1:8000/v1; 0 = any free)")
    up.add_argument("--no-http", action="store_true", help="serve the gRPC API only")
    up.add_argument("--tls", action="store_true",
                    help="a CA of the cluster's own (in the log folder): TLS on the router's ports, mutual TLS between "
                         "the services; clients trust <log-dir>/pki/ca.crt")
    # the services' own settings, passed on when given
    RouterSettings.add_flags(up, UP_ROUTER_SETTINGS, environment=False)
    VerifierSettings.add_flags(up, UP_VERIFIER_SETTINGS, environment=False)
    up.add_argument("--demo-prompt", default=DEMO_PROMPT, help="the demo's open request")
    up.add_argument("--demo-grounded-prompt", default=GROUNDED_DEMO_PROMPT,
                    help="the demo's grounded request (its answer rewrites text it holds)")
    up.add_argument("--max-tokens", type=int, default=96, help="of each demo request")
    up.add_argument("--no-demo", action="store_true")
    up.add_argument("--exit-after-demo", action="store_true", help="stop the cluster after the demo (for scripts)")
    up.add_argument("--log-dir", default=None, help="where each process logs (default: a new temporary folder)")


def _add_bench(commands) -> None:
    """The ``bench`` command: speed against plain and Hugging Face's assisted decoding."""
    bench = commands.add_parser("bench", help="measure speed against plain and HF assisted decoding")
    bench.add_argument("--prompts", help="JSONL prompts, or 'grounded' (requests that rewrite text they hold, "
                       "built from Python's standard library; give them --max-tokens 256) (default: MT-Bench first turns)")
    bench.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    bench.add_argument("--per-category", type=int, default=None, help="only the first N prompts of each category")
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--json", dest="json_out", help="write the summary (see shared/BENCH.md) here")
    bench.add_argument("--skip-baselines", action="store_true", help="skip Hugging Face's plain and assisted decoding")
    bench.add_argument("--no-cluster", action="store_true", help="skip the runs through a local cluster")
    bench.add_argument("--no-secure-cluster", action="store_true",
                       help="skip the second cluster (TLS, mutual TLS, API key) that measures what security costs")
    bench.add_argument("--concurrency", default="1,4,16",
                       help="the load sweep's concurrency levels through the cluster, comma-separated; '' skips it "
                       "(default 1,4,16)")
    bench.add_argument("--fixed-tree-nodes", type=int, default=DEFAULT_FIXED_TREE_NODES,
                       help="the budget of fixed-k speculation (router_fixed and the load sweep's fixed policy), "
                       "every step; the adaptive modes and each single drafter get --tree-nodes (default "
                       f"{DEFAULT_FIXED_TREE_NODES}, from `specmesh tune`)")
    bench.add_argument("--sweep-rounds", type=int, default=3,
                       help="runs of each policy at each concurrency in the load sweep, in rotated orders (default 3)")
    bench.add_argument("--plots", metavar="DIR", help="also write PNG plots here (speedup per category; latency vs load)")
    bench.add_argument("--skip-drafter-report", action="store_true",
                       help="skip the teacher-forced agreement of each drafter on MT-Bench")
    bench.add_argument("--report-drafter", action="append", default=None,
                       help="drafters to measure by teacher forcing (default: the model-free ones and every "
                       "expert shipped for the target); repeatable")
    bench.add_argument("--context", type=int, default=512,
                       help="with --model random:<architecture>: committed tokens while steps are timed (default 512)")
    bench.add_argument("--repeats", type=int, default=30,
                       help="with --model random:<architecture>: timed calls of each pass (default 30)")
    bench.add_argument("--oracle-acceptance", metavar="P[,P...]",
                       help="with --model random:<architecture>: the whole cluster instead of the runtime alone, with "
                       "an oracle drafter whose tokens are the target's own with probability P; tokens/s against "
                       "plain decoding through the same cluster at each --concurrency (docs/bench.md)")
    bench.add_argument("--oracle-width", type=int, default=1,
                       help="with --oracle-acceptance: the oracle's ranked guesses a position (1: chains; more: trees "
                       "grown best-first, the target's token its r-th guess with probability P (1 - P)^(r - 1))")
    _add_model_args(bench)
    VerifierSettings.add_flags(bench, ["offload"], defaults=True, environment=False)


def _add_tune(commands) -> None:
    """The ``tune`` command: the speculation constants measured on held-out prompts."""
    tune = commands.add_parser("tune", help="measure the speculation constants on held-out prompts (not MT-Bench)")
    tune.add_argument("--prompts", help="JSONL prompts sharing no word 8-gram with MT-Bench, or 'grounded' (the "
                      "grounded set's tuning half) (default: the shipped held-out set, specmesh/bench/tuning_prompts.jsonl)")
    tune.add_argument("--max-tokens", type=int, default=64)
    tune.add_argument("--tree-nodes-candidates", default="8,16,24,32", help="adaptive budget caps to compare")
    tune.add_argument("--fixed-tree-nodes-candidates", default="4,8,16", help="fixed k to compare")
    tune.add_argument("--sweeps", default="budget,margin",
                      help="which to run, comma-separated: budget (caps and fixed k), margin (in process), cluster "
                      "(OpenMP spin), load (the margin under concurrent load; one cluster per margin) "
                      "(default budget,margin: the in-process ones)")
    tune.add_argument("--margins", default="0.1,0.3,0.6,1", help="SPECULATION_MARGIN values to compare")
    tune.add_argument("--batch", type=int, default=4, help="requests a pass in the margin sweep (default 4)")
    tune.add_argument("--cluster-rounds", type=int, default=2, help="passes over the cluster settings (default 2)")
    tune.add_argument("--load-concurrency", default="4,16", help="concurrent requests of the load sweep (default 4,16)")
    tune.add_argument("--load-rounds", type=int, default=3, help="paired rounds at each concurrency (default 3)")
    tune.add_argument("--json", dest="json_out", help="write what was measured here")
    _add_model_args(tune)
    VerifierSettings.add_flags(tune, ["offload"], defaults=True, environment=False)


def _add_distill(commands) -> None:
    """The ``distill`` command: an expert or feature drafter trained for a target."""
    dist = commands.add_parser("distill", help="train a drafter for a target: an expert on one domain, or a "
                               "feature drafter that reads the target's hidden states (--kind feature)")
    dist.add_argument("--kind", choices=("expert", "feature"), default="expert",
                      help="expert: a small LM over tokens, for --domain; feature: one head over the target's hidden "
                      "states, for every domain (trained on the templated prompts of all of them, and --synthesize)")
    VerifierSettings.add_flags(dist, ["model"], defaults=True, environment=False)
    dist.add_argument("--domain",
                      help="code, math, writing, knowledge; general (every request not code or math: with --synthesize); "
                      "any name with --prompts (required for --kind expert)")
    dist.add_argument("--prompts", help="JSONL training prompts (default: specmesh's templated prompts for --domain)")
    dist.add_argument("--count", type=int, default=1200, help="templated prompts to make when --prompts is absent")
    dist.add_argument("--synthesize", type=int, default=0, metavar="N",
                      help="train on those of N requests the target writes itself (cached per target) that the "
                      "request classifier puts in --domain, instead of templated prompts; --kind feature: on all N, "
                      "beside the templated prompts")
    dist.add_argument("--out", required=True, help="the drafter directory to write")
    dist.add_argument("--minutes", type=float, help="training time budget (default: 10 for an expert; a feature "
                      "drafter trains for --epochs)")
    dist.add_argument("--steps", type=int, default=0,
                      help="train exactly this many steps instead of for --minutes: a run that repeats on any machine")
    dist.add_argument("--layers", type=int, default=3)
    dist.add_argument("--learning-rate", type=float, help="default: 2e-3 for an expert, 1e-3 for a feature drafter")
    dist.add_argument("--batch-tokens", type=int, help="padded tokens per training batch (default: 2048 for an expert, "
                      "4096 for a feature drafter)")
    dist.add_argument("--subset-size", type=int, default=8192, help="output head vocabulary subset (default 8192)")
    dist.add_argument("--answer-tokens", type=int, default=128,
                      help="max tokens of each target answer (default 128: many short answers teach more than few long ones)")
    dist.add_argument("--boost-from", action="append", default=[],
                      help="an earlier drafter of the set, a shipped expert's name or a drafter directory: positions "
                      "it gets wrong weigh more (repeatable)")
    dist.add_argument("--seed", type=int, default=0)
    VerifierSettings.add_flags(dist, ["threads"], defaults=True, environment=False)
    dist.add_argument("--feature-layers", help="--kind feature: the target's layers read, comma-separated counts of "
                      "decoder layers (default: a low, the middle and the top one)")
    dist.add_argument("--format", choices=("specmesh", "eagle3"), default="specmesh",
                      help="--kind feature: write a specmesh drafter directory, or an EAGLE-3 checkpoint in the "
                      "published layout (served as --drafter eagle3:DIR, read by other engines too; its default "
                      "layers are EAGLE-3's, 2, N/2 and N-3)")
    dist.add_argument("--epochs", type=float, default=4.0, help="--kind feature: passes over the answers (default 4)")
    dist.add_argument("--unroll", type=int, default=3,
                      help="--kind feature: drafting steps unrolled in training (training-time test; default 3)")
    VerifierSettings.add_flags(dist, ["precision"], defaults=True, environment=False)  # --kind feature: the verifiers'


def _add_drafters(commands) -> None:
    """The ``drafters check`` command: each drafter's fit, cost and agreement."""
    cards = commands.add_parser("drafters", help="check drafters against a target: whether each fits, what a "
                                "drafted token costs against the target's step, how often it guesses right")
    cards.add_argument("action", choices=("check",))
    VerifierSettings.add_flags(cards, ["model"], defaults=True, environment=False)
    cards.add_argument("--drafter", action="append", required=True,
                       help="a drafter as --drafter of `generate` takes it (eagle3:DIR, eagle:DIR too); repeatable")
    cards.add_argument("--prompts", help="JSONL prompts whose greedy answers the drafters are checked on (default: "
                       "MT-Bench first turns)")
    cards.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    cards.add_argument("--max-tokens", type=int, default=64, help="tokens of each answer (default 64)")
    cards.add_argument("--drafter-device", default=None, help="where the drafters run (default: their own choice)")
    cards.add_argument("--json", dest="json_out", help="write the cards here")
    VerifierSettings.add_flags(cards, ["device", "dtype", "precision", "threads", "kv_cache_gb", "batch_invariant"],
                               defaults=True, environment=False)


def _add_prepare(commands) -> None:
    """The ``prepare`` command: the embedded model converted, its kernel built."""
    prep = commands.add_parser("prepare", help="convert the embedded default model and build its quantized kernel once "
                               "(done by make install)")
    VerifierSettings.add_flags(prep, ["model"], defaults=True, environment=False)
    prep.add_argument("--every-cpu-kernel", action="store_true",
                      help="build the CPU kernels for every x86 CPU (AVX-512 VNNI, AVX-VNNI, AVX2, portable), not only "
                      "this one's: for an image that will run on other machines")


def _add_redis_acl(commands) -> None:
    """The ``redis-acl`` command: an ACL file with a user per role."""
    acl = commands.add_parser("redis-acl", help="print Redis ACL file lines giving each role (router, verifier, "
                              "drafter) only the commands and keys it needs (docs/security.md)")
    acl.add_argument("--role", action="append", choices=("router", "verifier", "drafter"),
                     help="repeatable (default: all three)")
    acl.add_argument("--prefix", default="specmesh", help="the key prefix of the queue (default specmesh)")
    acl.add_argument("--passwords-from-env", action="store_true",
                     help="each role's password from $SPECMESH_REDIS_<ROLE>_PASSWORD instead of a fresh one")
    acl.add_argument("--admin-password-env", metavar="VAR",
                     help="also the default user, with every right, its password from $VAR (an ACL file replaces "
                          "requirepass)")
    acl.add_argument("--output", help="write the ACL file here instead of printing it")


def _add_verifier(commands) -> None:
    """The ``verifier`` command: a verifier's control API."""
    control = commands.add_parser("verifier", help="call a verifier's control API: info, or drain (it stops taking "
                                  "work and finishes what it holds), with the cluster's credential")
    control.add_argument("action", choices=("info", "drain"))
    control.add_argument("--address", required=True, help="the verifier's control port, host:port")
    control.add_argument("--queue-key-file", help="the cluster's queue key (default: $SPECMESH_QUEUE_KEY)")
    control.add_argument("--tls-cert", help="with --tls-key and --tls-ca: call over the cluster's mutual TLS")
    control.add_argument("--tls-key")
    control.add_argument("--tls-ca")
    control.add_argument("--tls-server-name", help="the name expected in the verifier's certificate")


def _verifier_control(args) -> int:
    import grpc

    from specmesh.cluster.control import call_verifier
    from specmesh.cluster.pipeline.messages import QueueSigner
    from specmesh.cluster.tls import TlsFiles

    tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    try:
        answer = call_verifier(args.address, args.action, QueueSigner.from_environment(args.queue_key_file), tls,
                               args.tls_server_name)
    except grpc.RpcError as exc:
        print(f"specmesh: the verifier at {args.address} answered {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download weights at run time
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the benchmarks record the command that ran
    try:
        if args.command == "generate":
            return _generate_remote(args) if args.server else _generate(args)
        if args.command == "up":
            return _up(args)
        if args.command == "bench" and is_random(args.model) and args.oracle_acceptance:
            from specmesh.bench.oracle_cluster import run_oracle_bench

            return run_oracle_bench(args)
        if args.command == "bench" and is_random(args.model):  # the runtime alone: random weights, no text
            from specmesh.bench.runtime_speed import run_runtime_bench

            return run_runtime_bench(args)
        if args.command == "bench":
            from specmesh.bench.run import run_bench

            return run_bench(args)
        if args.command == "tune":
            from specmesh.bench.tune import run_tune

            return run_tune(args)
        if args.command == "drafters":
            from specmesh.bench.drafter_card import run_check

            return run_check(args)
        if args.command == "distill":
            return _distill(args)
        if args.command == "redis-acl":
            return _redis_acl(args)
        if args.command == "verifier":
            return _verifier_control(args)
        if args.command == "prepare":
            from specmesh.runtime.target import prepare_target

            print(prepare_target(args.model, every_cpu_kernel=args.every_cpu_kernel))
            return 0
    except InvalidArgument as exc:
        parser.exit(2, f"specmesh: error: {exc}\n")
    except SpecmeshError as exc:
        parser.exit(1, f"specmesh: {exc}\n")
    except KeyboardInterrupt:
        return 130
    return 0


def _sampling_params(args: argparse.Namespace):
    from specmesh.sampling import SamplingParams

    if args.greedy and args.temperature != 0:
        raise InvalidArgument("temperature", "--greedy and --temperature > 0 contradict each other")
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )


def _generate(args: argparse.Namespace) -> int:
    from specmesh.prompts import Prompt, load_prompts
    from specmesh.runtime.loading import configure_threads
    from specmesh.speculation.assembly import assemble
    from specmesh.speculation.classifier import default_classifier

    if (args.prompt is None) == (args.prompts is None):
        raise InvalidArgument("prompt", "give either a PROMPT or --prompts FILE.jsonl")
    params = _sampling_params(args)
    prompts = [Prompt(args.prompt)] if args.prompt is not None else load_prompts(args.prompts)
    configure_threads(args.threads)
    assembly = assemble(args.model, args.drafter or ["ngram"], device=args.device, dtype=args.dtype,
                        precision=args.precision, kv_cache_gb=args.kv_cache_gb or None, batch_invariant=args.batch_invariant,
                        offload=args.offload)
    speculative = assembly.engine(args.max_tree_nodes, args.speculation or "adaptive")
    plain = assembly.engine(0)
    classifier = default_classifier()
    tokenizer = assembly.target.tokenizer
    totals = {"tokens": 0, "time": 0.0, "steps": 0, "plain_time": 0.0, "identical": 0}
    for number, prompt in enumerate(prompts, start=1):
        request = assembly.request(prompt.text, params, classifier)
        started = time.perf_counter()
        (result,) = speculative.generate([request])
        elapsed = time.perf_counter() - started
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if len(prompts) > 1:
            print(f"--- [{number}/{len(prompts)}] {prompt.category}")
        print(text)
        stats = result.stats
        speed = len(result.token_ids) / elapsed
        print(f"[{len(result.token_ids)} tokens, {speed:.1f} tok/s, mean accepted length "
              f"{stats.mean_accepted_length:.2f}, finish: {result.finish_reason}; {_routing_line(stats)}]")
        totals["tokens"] += len(result.token_ids)
        totals["time"] += elapsed
        totals["steps"] += stats.target_steps
        if args.compare_plain:
            started = time.perf_counter()
            (reference,) = plain.generate([request])
            plain_elapsed = time.perf_counter() - started
            totals["plain_time"] += plain_elapsed
            same = reference.token_ids == result.token_ids
            totals["identical"] += same
            verdict = ("identical" if same else "DIFFERENT") if params.greedy else "n/a (sampling)"
            plain_speed = len(reference.token_ids) / plain_elapsed
            print(f"[plain: {plain_speed:.1f} tok/s; outputs {verdict}; speedup {speed / plain_speed:.2f}x]")
        sys.stdout.flush()
    if len(prompts) > 1:
        mean_len = totals["tokens"] / max(totals["steps"], 1)
        line = f"=== {len(prompts)} prompts: {totals['tokens'] / totals['time']:.1f} tok/s, mean accepted length {mean_len:.2f}"
        if args.compare_plain and totals["plain_time"]:
            line += f", speedup {totals['plain_time'] / totals['time']:.2f}x"
            if params.greedy:
                line += f", identical {totals['identical']}/{len(prompts)}"
        print(line)
    return 0


def _routing_line(stats) -> str:
    """How a request was routed: its kind and the steps each drafter drafted for."""
    kind = stats.request_kind
    steps = ", ".join(f"{name} {count}" for name, count in sorted(stats.drafter_steps.items(), key=lambda kv: -kv[1]))
    return f"routed as {kind or 'general'}: " + (f"drafter steps {steps}" if steps else "no drafting (plain decoding)")


def _demo(client, label: str, prompt: str, params) -> None:
    """One demo request through the cluster, speculative and plain, each twice in the order spec, plain,
    plain, spec (a lone run of a second varies by ~15 % on a shared machine), with both speeds."""
    print(f"\ndemo, {label} request: {prompt}\n", flush=True)
    tokens, elapsed, last = _stream_one(client, prompt, params, None, echo=True)
    plain, plain_elapsed, _ = _stream_one(client, prompt, params, 0, echo=False, speculation="off")
    plain_again, plain_again_elapsed, _ = _stream_one(client, prompt, params, 0, echo=False, speculation="off")
    again, again_elapsed, _ = _stream_one(client, prompt, params, None, echo=False)
    speed = (len(tokens) + len(again)) / (elapsed + again_elapsed)
    plain_speed = (len(plain) + len(plain_again)) / (plain_elapsed + plain_again_elapsed)
    same = plain == tokens == plain_again == again
    print(f"\n[{label} request: {len(tokens)} tokens, {speed:.1f} tok/s through the cluster (two runs), mean accepted "
          f"length {last.stats.mean_accepted_length:.2f}, first token {last.stats.first_token_ms:.0f} ms; "
          f"{_routing_line(last.stats)}]")
    print(f"[{label} request without speculation: {plain_speed:.1f} tok/s; speedup {speed / plain_speed:.2f}x; "
          f"outputs {'identical' if same else 'DIFFERENT'}]", flush=True)


def _stream_one(client, text: str, params, tree_nodes: int | None, echo: bool, speculation: str | None = None):
    """Stream one chat prompt through the cluster; returns (token ids, seconds, last chunk)."""
    started = time.perf_counter()
    tokens: list[int] = []
    last = None
    for chunk in client.stream(chat=[("user", text)], max_tokens=params.max_tokens, temperature=params.temperature,
                               top_k=params.top_k, top_p=params.top_p, seed=params.seed, max_tree_nodes=tree_nodes,
                               speculation=speculation):
        tokens += chunk.token_ids
        last = chunk
        if echo:
            print(chunk.text, end="", flush=True)
    if echo:
        print()
    return tokens, time.perf_counter() - started, last


def _generate_remote(args: argparse.Namespace) -> int:
    from specmesh.client import Client
    from specmesh.prompts import Prompt, load_prompts

    if (args.prompt is None) == (args.prompts is None):
        raise InvalidArgument("prompt", "give either a PROMPT or --prompts FILE.jsonl")
    params = _sampling_params(args)
    prompts = [Prompt(args.prompt)] if args.prompt is not None else load_prompts(args.prompts)
    with Client(args.server, api_key=args.api_key, tls_ca=args.tls_ca) as client:
        for number, prompt in enumerate(prompts, start=1):
            if len(prompts) > 1:
                print(f"--- [{number}/{len(prompts)}] {prompt.category}")
            tokens, elapsed, last = _stream_one(client, prompt.text, params, args.max_tree_nodes, echo=True,
                                                speculation=args.speculation)
            stats = last.stats
            line = (f"[{len(tokens)} tokens, {len(tokens) / elapsed:.1f} tok/s, mean accepted length "
                    f"{stats.mean_accepted_length:.2f}, first token {stats.first_token_ms:.0f} ms, finish: {last.finish_reason}; "
                    f"{_routing_line(stats)}]")
            if args.compare_plain:
                plain, plain_elapsed, _ = _stream_one(client, prompt.text, params, 0, echo=False, speculation="off")
                verdict = ("identical" if plain == tokens else "DIFFERENT") if params.greedy else "n/a (sampling)"
                line += f"\n[plain through the cluster: {len(plain) / plain_elapsed:.1f} tok/s; outputs {verdict}; " \
                        f"speedup {(len(tokens) / elapsed) / (len(plain) / plain_elapsed):.2f}x]"
            print(line, flush=True)
    return 0


def _redis_acl(args: argparse.Namespace) -> int:
    """One ACL line per role (a fresh password each, unless given in the environment); the matching URLs of
    fresh passwords go to stderr."""
    import secrets

    from specmesh.cluster.redis_acl import ROLES, acl_line, admin_line, redis_user

    lines = []
    if args.admin_password_env:
        lines.append(admin_line(_env_password(args.admin_password_env)))
    for role in args.role or ROLES:
        password = (_env_password(f"SPECMESH_REDIS_{role.upper()}_PASSWORD") if args.passwords_from_env
                    else secrets.token_urlsafe(24))
        lines.append(acl_line(role, redis_user(role), password, args.prefix))
        if not args.passwords_from_env:
            print(f"# {role}: SPECMESH_REDIS_URL=redis://{redis_user(role)}:{password}@HOST:6379/0", file=sys.stderr)
    if args.output:
        Path(args.output).write_text("".join(f"{line}\n" for line in lines))
    else:
        print("\n".join(lines))
    return 0


def _env_password(variable: str) -> str:
    value = os.environ.get(variable, "")
    if not value:
        raise InvalidArgument("password", f"${variable} is not set")
    return value


def _up(args: argparse.Namespace) -> int:
    from specmesh.cluster.launcher import DEFAULT_DRAFTERS, ClusterSpec, LocalCluster

    spec = ClusterSpec(model=args.model, drafters=tuple(args.drafter or DEFAULT_DRAFTERS), verifiers=args.verifiers,
                       routers=args.routers, max_tree_nodes=args.max_tree_nodes, router_port=args.port,
                       http_port=None if args.no_http else args.http_port,
                       api_keys_file=Path(args.api_keys_file) if args.api_keys_file else None, tls=args.tls,
                       log_dir=args.log_dir, speculation=args.speculation, speculation_margin=args.speculation_margin,
                       precision=args.precision, kv_cache_gb=args.kv_cache_gb, batch_invariant=args.batch_invariant,
                       offload=args.offload, tensor_parallel=args.tensor_parallel)
    cluster = LocalCluster(spec)
    print(f"starting Redis, {spec.verifiers} verifier(s), drafters {', '.join(spec.drafters)} (model-free ones "
          "inside the router) and the router "
          f"(logs: {cluster.log_dir}) ...", flush=True)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupted)  # as Ctrl-C: drain the cluster, then exit 0
    signal.signal(signal.SIGINT, _interrupted)
    try:
        return _serve_cluster(cluster, args, started)
    except KeyboardInterrupt:
        print("\nstopped", flush=True)
        return 0


def _interrupted(signum, frame) -> None:
    """Ctrl-C or SIGTERM: stop, once (a second signal while the cluster drains is ignored)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _serve_cluster(cluster, args: argparse.Namespace, started: float) -> int:
    import grpc

    from specmesh.client import Client
    from specmesh.cluster.auth import ENV_KEYS
    from specmesh.sampling import SamplingParams

    spec = cluster.spec
    with cluster:
        print(f"cluster up in {time.perf_counter() - started:.0f} s", flush=True)
        for process in cluster.processes():
            print(f"  {process.name:<18} {process.address:<18} metrics {process.metrics_url}")
        if cluster.redis is not None:
            print(f"  {'redis':<18} {cluster.redis.address} (with its password: {cluster.redis_url_file})")
        if cluster.http_url:
            print(f"  {'OpenAI API':<18} {cluster.http_url}")
        if cluster.tls is not None:
            print(f"  {'TLS':<18} clients trust {cluster.tls.ca}; the services call each other with mutual TLS")
        keyed = spec.api_keys_file is not None or os.environ.get(ENV_KEYS)
        print("  API keys required (authorization: Bearer <key>)" if keyed
              else "  no API keys configured: serving on loopback only, without authentication")
        try:
            if not args.no_demo:
                params = SamplingParams(max_tokens=args.max_tokens)
                with Client(cluster.router_addresses, api_key=cluster.client_key, tls_ca=cluster.client_tls_ca) as client:
                    _stream_one(client, args.demo_prompt, params, None, echo=False)  # warm-up: caches and allocators
                    for label, prompt in (("open", args.demo_prompt), ("grounded", args.demo_grounded_prompt)):
                        _demo(client, label, prompt, params)
        except grpc.RpcError as exc:
            raise SpecmeshError(f"the demo request failed: {exc.code().name}: {exc.details()}") from None
        if args.exit_after_demo:
            return 0
        http_note = f" and {cluster.http_url} (OpenAI API)" if cluster.http_url else ""
        addresses = ",".join(cluster.router_addresses)
        print(f"\nserving on {addresses} (gRPC){http_note} — try: specmesh generate --server "
              f"{addresses} \"Hello!\"  (Ctrl-C stops the cluster)", flush=True)
        try:
            while not cluster.supervisor.failed.wait(1.0):  # what dies is restarted; a vital part's crash loop ends it
                pass
            print(f"specmesh: shutting the cluster down (logs: {cluster.log_dir})", flush=True)
            cluster.keep_logs = True
            return 1
        except KeyboardInterrupt:
            print("\nstopping: draining the services ...", flush=True)
            raise


def boost_directory(spec: str, target_name: str) -> Path:
    """``--boost-from``'s drafter: a shipped expert's name or a drafter directory."""
    from specmesh.drafters.catalog import expert_directory, shipped_experts

    directory = expert_directory(spec, target_name)
    if directory is None:
        raise InvalidArgument("boost_from", f"{spec!r} is neither one of {target_name!r}'s shipped experts "
                              f"({', '.join(shipped_experts(target_name)) or 'none'}) nor a drafter directory")
    return directory


def _distill_defaults(args: argparse.Namespace, feature: bool) -> None:
    """The training settings a kind of drafter defaults to (a feature head: by steps, larger batches), checked."""
    if args.format != "specmesh" and not feature:
        raise InvalidArgument("format", f"{args.format} is a layout of feature heads: add --kind feature")
    args.minutes = args.minutes if args.minutes is not None else (0.0 if feature else 10.0)
    args.learning_rate = args.learning_rate if args.learning_rate is not None else (1e-3 if feature else 2e-3)
    args.batch_tokens = args.batch_tokens if args.batch_tokens is not None else (4096 if feature else 2048)
    if args.minutes < 0 or (args.minutes == 0 and not feature):
        raise InvalidArgument("minutes", f"must be > 0, got {args.minutes}")
    if not 0 < args.learning_rate < 1:
        raise InvalidArgument("learning_rate", f"must be in (0, 1), got {args.learning_rate}")
    if args.batch_tokens < 64:
        raise InvalidArgument("batch_tokens", f"must be >= 64, got {args.batch_tokens}")


def _check_expert_args(args: argparse.Namespace) -> None:
    """An expert's own arguments: its domain, the student's shape, where its prompts come from."""
    from specmesh.distill.templates import DOMAINS
    from specmesh.speculation.expertise import GENERAL

    if not args.domain:
        raise InvalidArgument("domain", "an expert is trained for one domain: give --domain")
    if args.steps < 0:
        raise InvalidArgument("steps", f"must be >= 0 (0: train for --minutes), got {args.steps}")
    if not 1 <= args.layers <= 64:
        raise InvalidArgument("layers", f"must be in 1..64, got {args.layers}")
    if args.subset_size < 16:
        raise InvalidArgument("subset_size", f"must be >= 16, got {args.subset_size}")
    if args.synthesize < 0:
        raise InvalidArgument("synthesize", f"must be >= 0, got {args.synthesize}")
    if args.synthesize and args.prompts:
        raise InvalidArgument("synthesize", "give --prompts or --synthesize, not both")
    if args.synthesize and args.domain not in (*DOMAINS, GENERAL):
        raise InvalidArgument("domain", f"--synthesize keeps the requests classified as one of {sorted(DOMAINS)} "
                              f"or {GENERAL!r} (all but code and math), not {args.domain!r}")


def _distill(args: argparse.Namespace) -> int:
    feature = args.kind == "feature"
    _distill_defaults(args, feature)
    if feature:
        return _distill_feature(args)
    _check_expert_args(args)
    from specmesh.distill.overlap import without_benchmark
    from specmesh.distill.recipe import distill, synthesized_prompts
    from specmesh.distill.templates import domain_prompts
    from specmesh.distill.train import TrainConfig
    from specmesh.prompts import load_prompts
    from specmesh.runtime.loading import configure_threads
    from specmesh.speculation.assembly import assemble

    prompts = None
    if args.prompts:
        prompts = without_benchmark(load_prompts(args.prompts))  # before loading the model: refused at once
    if prompts is None and not args.synthesize:
        prompts = domain_prompts(args.domain, args.count, args.seed)
    configure_threads(args.threads)
    # fp32: the shipped experts were distilled from (and their answer caches hold) the fp32 target
    assembly = assemble(args.model, drafters=[], dtype="float32", precision="fp32")
    boost_from = [boost_directory(spec, assembly.target.name) for spec in args.boost_from]  # before any generation
    if prompts is None:
        prompts = synthesized_prompts(assembly, args.domain, args.synthesize, args.seed)
        print(f"{len(prompts)} of {args.synthesize} target-written requests are {args.domain} requests")
        if not prompts:
            raise InvalidArgument("synthesize", f"none of the {args.synthesize} requests is a {args.domain} request; draw more")
    config = TrainConfig(layers=args.layers, subset_size=args.subset_size, minutes=args.minutes, steps=args.steps, seed=args.seed,
                         learning_rate=args.learning_rate, tokens_per_batch=args.batch_tokens)
    spec = distill(assembly, args.domain, prompts, Path(args.out), config, boost_from=boost_from,
                   max_answer_tokens=args.answer_tokens)
    measured = spec.measured
    print(f"drafter {spec.name} ({spec.domain}) written to {args.out}")
    print(f"  MT-Bench agreement: {measured['mtbench_agreement']}")
    print(f"  expected tokens per step (k=1..8): {measured['mtbench_expected_tokens_per_step']}")
    print(f"  cost {measured['cost_ms']} ms per drafted token = {measured['cost_fraction']:.3f} of a target step")
    return 0


def _distill_feature(args: argparse.Namespace) -> int:
    import itertools
    import shlex

    from specmesh.distill.feature_recipe import default_feature_layers, distill_feature
    from specmesh.drafters.eagle import default_layers as eagle3_layers
    from specmesh.distill.feature_train import FeatureTrainConfig
    from specmesh.distill.overlap import without_benchmark
    from specmesh.distill.recipe import target_written_requests
    from specmesh.distill.templates import DOMAINS, domain_prompts
    from specmesh.prompts import Prompt, load_prompts
    from specmesh.runtime.llama import check_feature_layers
    from specmesh.runtime.loading import configure_threads
    from specmesh.speculation.assembly import assemble

    if args.epochs <= 0:
        raise InvalidArgument("epochs", f"must be > 0, got {args.epochs}")
    if not 1 <= args.unroll <= 8:
        raise InvalidArgument("unroll", f"must be in 1..8, got {args.unroll}")
    if args.subset_size < 16:
        raise InvalidArgument("subset_size", f"must be >= 16, got {args.subset_size}")
    if args.synthesize < 0:
        raise InvalidArgument("synthesize", f"must be >= 0, got {args.synthesize}")
    configure_threads(args.threads)
    assembly = assemble(args.model, drafters=[], precision=args.precision)
    num_layers = assembly.target.model.config.num_hidden_layers
    try:
        layers = (tuple(int(n) for n in args.feature_layers.split(",")) if args.feature_layers
                  else eagle3_layers(num_layers) if args.format == "eagle3" else default_feature_layers(num_layers))
    except ValueError:
        raise InvalidArgument("feature_layers", f"must be comma-separated integers, got {args.feature_layers!r}") from None
    check_feature_layers(layers, num_layers)
    if args.prompts:
        prompts = without_benchmark(load_prompts(args.prompts))  # before the store is recorded: refused at once
    else:  # every domain, interleaved: a store cut short is still balanced
        groups = [domain_prompts(domain, args.count, args.seed) for domain in DOMAINS]
        prompts = [p for group in itertools.zip_longest(*groups) for p in group if p is not None]
    if args.synthesize:  # their variety is what templates lack; interleaved, as the domains are
        written = [Prompt(text, "synthesized") for text in target_written_requests(assembly, args.synthesize, args.seed)]
        prompts = [p for pair in itertools.zip_longest(prompts, written) for p in pair if p is not None]
    config = FeatureTrainConfig(subset_size=args.subset_size, unroll=args.unroll, epochs=args.epochs, minutes=args.minutes,
                                learning_rate=args.learning_rate, tokens_per_batch=args.batch_tokens, seed=args.seed)
    command = "specmesh " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["distill"] else "specmesh distill --kind feature"
    spec = distill_feature(assembly, prompts, Path(args.out), config, sorted(layers), command, args.answer_tokens,
                           eagle3=args.format == "eagle3")
    measured = spec.measured
    served = f" (serve it as --drafter eagle3:{args.out})" if args.format == "eagle3" else ""
    print(f"feature drafter {spec.name} (layers {list(layers)}) written to {args.out}{served}")
    print(f"  MT-Bench agreement: {measured['mtbench_agreement']}")
    print(f"  by depth past the last feature: {measured['mtbench_agreement_by_depth']}")
    print(f"  cost {measured['cost_ms']} ms for a first guess = {measured['cost_fraction']:.3f} of a target step; "
          f"{measured['further_guess_ms']} ms = {measured['further_guess_fraction']:.3f} for each further guess")
    return 0


if __name__ == "__main__":
    sys.exit(main())
