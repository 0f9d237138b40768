"""The full cluster on the real embedded model: routers admit requests to the verifiers over Redis, each
verifier runs their step loop beside the target with an n-gram drafter in its process and the code expert
as a drafter service (gRPC); each service a process started by its command line, as `specmesh up` does.

- greedy outputs identical to plain greedy decoding on 20 MT-Bench prompts, at concurrency 1 and 8
  (adaptive, and fixed: the expert drafts), through gRPC and the OpenAI API (whole and streamed);
- a stream the client leaves frees the request on the router and on the verifier;
- forged and unreadable admissions are dropped and counted; the verifiers go on serving;
- kill -9 of the busier verifier (of two) and of a drafter during 8 concurrent streams: the other verifier
  adopts its requests, every request completes with the undisturbed output, and the supervisor starts
  both again;
- kill -9 of a router (of two) during 8 streams through an SDK given both: the cut streams go on at the
  other router from the tokens received, every output the undisturbed one;
- Redis killed mid-run (and started again by the supervisor): each request completes (identically) or fails UNAVAILABLE,
  none hangs, and the cluster serves again once Redis is back;
- the only verifier killed and back after longer than the job timeout: its requests wait and complete.
"""

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from conftest import wait_until

from specmesh.cli import main
from specmesh.client import Client
from specmesh.cluster.control import call_verifier
from specmesh.cluster.launcher import ClusterSpec, LocalCluster, ServiceProcess
from specmesh.cluster.pipeline.messages import QueueKeys, QueueSigner
from specmesh.cluster.service_settings import VerifierSettings
from specmesh.prompts import encode_chat, mtbench_prompts
from specmesh.runtime.loading import EMBEDDED_DEFAULT, load_hf_model
from specmesh.runtime.target import target_runtime
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import eos_token_ids
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow
MAX_TOKENS = 64
NUM_PROMPTS = 20
JOB_TIMEOUT_S = 12.0
UNRESPONSIVE_S = 10.0  # the supervisor's patience with a process that says it is not serving


@pytest.fixture(scope="module")
def questions():
    every = mtbench_prompts()
    return [q.text for q in every[:: len(every) // NUM_PROMPTS][:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def plain_outputs(questions):
    """Plain greedy decoding of the target in the verifiers' default precision (its GGUF's own blocks;
    the runtime is checked against plain decoding in test_smollm2)."""
    target = load_hf_model(EMBEDDED_DEFAULT, dtype="float32", device="cpu")
    engine = SpeculativeEngine(target_runtime(target), [], max_tree_nodes=0, eos_token_ids=eos_token_ids(target))
    outputs = []
    for text in questions:
        (out,) = engine.generate([Request(tuple(encode_chat(target.tokenizer, text)), SamplingParams(max_tokens=MAX_TOKENS))])
        outputs.append(out.token_ids)
    return outputs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, plain_outputs):
    spec = ClusterSpec(drafters=("ngram", "code"), verifiers=2, routers=2, job_timeout_s=JOB_TIMEOUT_S,
                       unresponsive_s=UNRESPONSIVE_S, log_dir=tmp_path_factory.mktemp("cluster-logs"))
    with LocalCluster(spec) as running:
        yield running


def generate_all(client: Client, questions, concurrency: int):
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda q: client.generate(chat=[("user", q)], max_tokens=MAX_TOKENS), questions))


def metric_total(process: ServiceProcess, name: str, **labels: str) -> float:
    """The sum of a metric's samples (every label set, or those carrying ``labels``) as the service's
    /metrics shows it now."""
    return sum(sample.value for family in process.metrics() for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


# what each kind of service counts for every request: (metric, labels to filter by); the drafters' RPCs
# are counted by method, as the supervisor's health checks count too; the steps where the loop runs
STEPS = [(name, {}) for name in ("specmesh_target_steps_total", "specmesh_drafter_drafts_total",
                                 "specmesh_drafter_draft_tokens_total", "specmesh_routing_decisions_total")]
MOVING = {"router": [("specmesh_generated_tokens_total", {}), ("specmesh_routing_reports_total", {})],
          "drafter": [("specmesh_rpc_requests_total", {"method": "ProposeStream"})],
          "verifier": [("specmesh_verify_jobs_total", {}), ("specmesh_verify_batch_tokens_count", {}), *STEPS]}


@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_through_the_cluster_is_plain_greedy(cluster, questions, plain_outputs, concurrency):
    def totals():  # per kind of service (two verifiers share the jobs: one may get none)
        found: dict[tuple[str, str], float] = {}
        for process in cluster.processes():
            kind = process.name.split("-")[0]
            for name, labels in MOVING[kind]:
                found[kind, name] = found.get((kind, name), 0.0) + metric_total(process, name, **labels)
        return found

    def code_drafts():  # trees the step loops asked of the code expert (sessions open with the first one)
        return sum(metric_total(v, "specmesh_drafter_drafts_total", drafter="code") for v in cluster.verifiers)

    before, drafts_before = totals(), code_drafts()
    with Client(cluster.router_address) as client:
        results = generate_all(client, questions, concurrency)
    after, asked = totals(), code_drafts() > drafts_before
    # the adaptive router may leave the expert out (under load, or having learnt it does not pay): its
    # service then hears nothing at all
    still = [key for key in before if after[key] <= before[key] and (key[0] != "drafter" or asked)]
    assert not still, f"these metrics did not move during the requests: {still}"
    if not asked:
        assert after["drafter", "specmesh_rpc_requests_total"] == before["drafter", "specmesh_rpc_requests_total"]
    different = [i for i, (r, ref) in enumerate(zip(results, plain_outputs)) if r.token_ids != ref]
    assert not different, f"prompts {different} differ from plain greedy decoding"
    steps = sum(r.stats.target_steps for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    # alone, speculation must commit more than one token a step; at 8 at once on 2 cores the adaptive
    # policy may find that no tree pays for its verification (seen: 1226 tokens in 1226 steps), and
    # then it never speculates at all
    if concurrency == 1:
        assert tokens > steps
    assert all(r.usage.completion_tokens == len(r.token_ids) for r in results)


def test_the_openai_api_of_the_launched_cluster_is_plain_greedy(cluster, questions, plain_outputs):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from specmesh.runtime.loading import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(EMBEDDED_DEFAULT)[0])
    with OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0) as client:
        (model,) = client.models.list().data
        answers = [client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": q}],
                                                  max_tokens=MAX_TOKENS, temperature=0) for q in questions[:2]]
    for answer, reference in zip(answers, plain_outputs):
        assert answer.choices[0].message.content == tokenizer.decode(reference, skip_special_tokens=True)
        assert answer.usage.completion_tokens == len(reference)
    with OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(model=model.id, stream=True, temperature=0,
                                                messages=[{"role": "user", "content": questions[0]}],
                                                max_tokens=MAX_TOKENS)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == tokenizer.decode(plain_outputs[0], skip_special_tokens=True)


def test_fixed_speculation_drafts_with_the_expert_and_is_plain_greedy(cluster, questions, plain_outputs):
    """The whole budget every step: the code expert's service is asked, and its trees accepted in part at least."""
    drafter = next(d for d in cluster.drafters if d.name == "drafter-code")
    drafted_before = metric_total(drafter, "specmesh_rpc_requests_total", method="ProposeStream")
    with Client(cluster.router_address) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda q: client.generate(chat=[("user", q)], max_tokens=MAX_TOKENS,
                                                          speculation="fixed"), questions))
    different = [i for i, (r, ref) in enumerate(zip(results, plain_outputs)) if r.token_ids != ref]
    assert not different, f"prompts {different} differ from plain greedy decoding"
    assert all(r.stats.target_steps > 0 and r.stats.request_kind for r in results)
    steps, tokens = sum(r.stats.target_steps for r in results), sum(len(r.token_ids) for r in results)
    assert steps < tokens, (steps, tokens)
    assert metric_total(drafter, "specmesh_rpc_requests_total", method="ProposeStream") > drafted_before


def test_a_stream_the_client_leaves_is_freed_on_the_router_and_the_verifier(cluster, questions):
    signer = QueueSigner(cluster.queue_key)

    def sessions() -> int:
        return sum(call_verifier(v.address, "info", signer).get("active_sessions", 0) for v in cluster.verifiers)

    with Client(cluster.router_address) as client:
        stream = client.stream(chat=[("user", questions[1])], max_tokens=400)
        first = next(iter(stream))
        assert first.token_ids
        assert sessions() == 1
        stream.close()
    wait_until(lambda: sessions() == 0, timeout_s=30, what="the verifier frees the request's cache")
    wait_until(lambda: metric_total(cluster.router, "specmesh_requests_in_flight") == 0, timeout_s=30,
               what="the router lets the request go")


def admin_redis(cluster) -> redis.Redis:
    return redis.Redis.from_url(cluster.redis_url_file.read_text().strip())


def test_forged_and_unreadable_admissions_are_dropped_and_the_verifiers_serve_on(cluster, questions, plain_outputs):
    keys = QueueKeys()
    admission = verifier_pb2.Admission(request_id="forged", prompt=common_pb2.TokenIds(ids=[1, 2, 3]),
                                       sampling=common_pb2.SamplingParams(max_tokens=4), reply_to="specmesh:outputs:x")
    payload = admission.SerializeToString()

    def forged() -> float:
        return sum(metric_total(v, "specmesh_verify_jobs_total", outcome="forged") for v in cluster.verifiers)

    before = forged()
    with admin_redis(cluster) as r:
        r.xadd(keys.admissions, {"admission": payload, "tag": b"\x00" * 32})  # a wrong tag
        r.xadd(keys.admissions, {"admission": payload})  # none
        good_tag = QueueSigner(cluster.queue_key).tag(b"admission", b"\xff\xfe")
        r.xadd(keys.admissions, {"admission": b"\xff\xfe", "tag": good_tag})  # signed garbage
        wait_until(lambda: forged() >= before + 2, timeout_s=30, what="the forged admissions are counted")
        time.sleep(0.5)
        assert r.xlen("specmesh:outputs:x") == 0, "a forged admission is never served"
    with Client(cluster.router_address) as client:
        answer = client.generate(chat=[("user", questions[0])], max_tokens=MAX_TOKENS)
    assert answer.token_ids == plain_outputs[0]


def stream_collect(client: Client, question: str, first_tokens: threading.Barrier | None, at: int = 8):
    """The stream's tokens; ``first_tokens`` is waited on once ``at`` tokens have come."""
    tokens = []
    for chunk in client.stream(chat=[("user", question)], max_tokens=MAX_TOKENS):
        tokens += chunk.token_ids
        if first_tokens is not None and len(tokens) >= at:
            first_tokens.wait(timeout=120)
            first_tokens = None
    return tokens


def test_killing_a_verifier_and_a_drafter_loses_no_request(cluster, questions, plain_outputs):
    chosen = list(range(8))
    started = threading.Barrier(len(chosen) + 1)
    with Client(cluster.router_address) as client, ThreadPoolExecutor(len(chosen)) as pool:
        futures = [pool.submit(stream_collect, client, questions[i], started, 1) for i in chosen]
        started.wait(timeout=120)  # every stream is under way (its first token in: most of it to come)
        signer = QueueSigner(cluster.queue_key)
        held = {v.name: call_verifier(v.address, "info", signer).get("active_sessions", 0) for v in cluster.verifiers}
        busiest = max(cluster.verifiers, key=lambda v: held[v.name])
        assert held[busiest.name] > 0, held
        victims = [busiest, next(d for d in cluster.drafters if d.name == "drafter-code")]
        killed = [process.popen for process in victims]
        for process in victims:
            process.signal(signal.SIGKILL)
        outputs = [f.result(timeout=300) for f in futures]
        for popen in killed:
            assert popen.wait(5) == -signal.SIGKILL
        assert [outputs[k] for k in range(len(chosen))] == [plain_outputs[i] for i in chosen]
        after = client.generate(chat=[("user", questions[9])], max_tokens=MAX_TOKENS)  # still serving
        assert after.token_ids == plain_outputs[9]
        # the supervisor started both again, on their ports and under their ids
        for process, popen in zip(victims, killed):
            assert process.popen is not popen
            process.wait_ready(300)
        wait_until(lambda: client.info().verifiers == 2, timeout_s=120, what="the restarted verifier is alive")
        wait_until(lambda: all(d.healthy for d in client.info().drafters), timeout_s=120,
                   what="the router reaches the restarted drafter")
    assert any(f"{victims[0].name} stopped; restarting" in e for e in cluster.events)
    assert any(f"{victims[1].name} stopped; restarting" in e for e in cluster.events)
    log = "".join(v.log_path.read_text() for v in cluster.verifiers)
    assert "took over" in log, "a verifier adopted the killed one's requests"


def test_killing_a_router_loses_no_stream(cluster, questions, plain_outputs):
    chosen = list(range(10, 18))
    under_way = threading.Barrier(2)
    victim = cluster.routers[0]
    # a fresh client's first call goes to the first router: the watched stream is on the one killed
    with Client(cluster.router_addresses) as watched, Client(cluster.router_addresses) as client, \
            ThreadPoolExecutor(len(chosen)) as pool:
        first = pool.submit(stream_collect, watched, questions[chosen[0]], under_way)
        rest = [pool.submit(stream_collect, client, questions[i], None) for i in chosen[1:]]
        under_way.wait(timeout=120)  # the watched stream has 8 tokens
        killed = victim.popen
        victim.signal(signal.SIGKILL)
        outputs = [f.result(timeout=300) for f in [first, *rest]]
        assert killed.wait(5) == -signal.SIGKILL
        # the watched stream went on at the other router from its tokens; the rest retried or resumed
        assert outputs == [plain_outputs[i] for i in chosen]
        wait_until(lambda: victim.popen is not killed, timeout_s=60, what="the supervisor restarts the router")
        victim.wait_ready(300)
        after = client.generate(chat=[("user", questions[9])], max_tokens=MAX_TOKENS)  # both serve again
        again = client.generate(chat=[("user", questions[9])], max_tokens=MAX_TOKENS)
        assert after.token_ids == again.token_ids == plain_outputs[9]
    assert any(f"{victim.name} stopped; restarting" in e for e in cluster.events)


def test_redis_restart_fails_fast_or_completes_and_then_serves_again(cluster, questions, plain_outputs):
    chosen = list(range(10, 16))
    started = threading.Barrier(len(chosen) + 1)

    def run(i):
        try:
            return "ok", stream_collect(client, questions[i], started)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()

    with Client(cluster.router_address, retries=0) as client, ThreadPoolExecutor(len(chosen)) as pool:
        futures = [pool.submit(run, i) for i in chosen]
        started.wait(timeout=120)  # every stream is under way (its first token in: most of it to come)
        cluster.redis.stop()  # the supervisor starts it again, empty
        wait_until(cluster.redis.alive, what="the supervisor restarted Redis")
        results = [f.result(timeout=300) for f in futures]  # bounds a hang: a request waits JOB_TIMEOUT_S at most
    for i, (status, payload) in zip(chosen, results):
        if status == "ok":
            assert payload == plain_outputs[i]
        else:
            assert status == grpc.StatusCode.UNAVAILABLE, payload
    with Client(cluster.router_address) as client:
        # verifiers re-register in the emptied Redis; the router sees them alive again
        running = sum(v.alive() for v in cluster.verifiers)
        wait_until(lambda: client.info().verifiers == running, timeout_s=120,
                   what="the router sees every verifier alive again")
        again = client.generate(chat=[("user", questions[3])], max_tokens=MAX_TOKENS)
    assert again.token_ids == plain_outputs[3]


def test_sigterm_drains_a_verifier_without_losing_requests(cluster, questions, plain_outputs):
    spare = cluster.verifier_process(2)  # the one that takes over
    spare.start()
    cluster.verifiers.append(spare)
    spare.wait_ready(300)
    leaving = cluster.verifiers[1]
    chosen = [16, 17, 18, 19]
    started = threading.Barrier(len(chosen) + 1)
    with Client(cluster.router_address) as client, ThreadPoolExecutor(len(chosen)) as pool:
        futures = [pool.submit(stream_collect, client, questions[i], started, 1) for i in chosen]
        started.wait(timeout=120)
        drained = leaving.popen
        leaving.signal(signal.SIGTERM)
        outputs = [f.result(timeout=300) for f in futures]
    assert drained.wait(30) == 0  # drained and exited cleanly (and then started again by the supervisor)
    assert outputs == [plain_outputs[i] for i in chosen]


def test_the_verifiers_control_api_answers_the_cluster_only(cluster, monkeypatch, capsys):
    address = cluster.verifiers[0].address
    refused = {}
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        for name, metadata in (("no credential", []), ("a wrong token", [("authorization", "Bearer " + "x" * 64)]),
                               ("the queue key itself", [("authorization", f"Bearer {cluster.queue_key}")])):
            for call, request in ((stub.Drain, verifier_pb2.DrainRequest()), (stub.Info, verifier_pb2.VerifierInfoRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, metadata=metadata, timeout=10)
                refused[name, call is stub.Drain] = err.value.code()
    assert set(refused.values()) == {grpc.StatusCode.UNAUTHENTICATED}, refused
    info = call_verifier(address, "info", QueueSigner(cluster.queue_key))  # the cluster's control token
    assert info["verifier_id"] and not info.get("draining", False)
    assert info["max_batch_tokens"] == VerifierSettings().max_batch_rows
    monkeypatch.setenv("SPECMESH_QUEUE_KEY", cluster.queue_key)  # the operator's command, as docs/security.md shows
    assert main(["verifier", "info", "--address", address]) == 0
    out = capsys.readouterr().out  # the supervisor's lines may land around it (a restart in the background)
    assert json.JSONDecoder().raw_decode(out[out.index("{"):])[0]["verifier_id"] == info["verifier_id"]


def test_a_drained_verifier_that_stays_drained_is_restarted(cluster, questions, plain_outputs):
    victim = cluster.verifiers[0]
    victim.wait_ready(300)  # the earlier tests may have restarted it
    drained = victim.popen
    started = time.monotonic()
    call_verifier(victim.address, "drain", QueueSigner(cluster.queue_key))  # a refusal raises
    wait_until(lambda: not victim.serving(), timeout_s=10, what="the drained verifier says NOT_SERVING")
    wait_until(lambda: victim.popen is not drained, timeout_s=UNRESPONSIVE_S + 30,
               what="the supervisor kills the drained verifier and starts it again")
    assert time.monotonic() - started >= UNRESPONSIVE_S - 3  # not before it had its time (probes every 2 s)
    assert drained.wait(5) == -signal.SIGKILL
    victim.wait_ready(300)
    assert any(f"{victim.name} has not been serving" in e for e in cluster.events)
    with Client(cluster.router_address) as client:
        wait_until(lambda: client.info().verifiers == len(cluster.verifiers), timeout_s=120,
                   what="the router sees the restarted verifier")
        assert client.generate(chat=[("user", questions[5])], max_tokens=MAX_TOKENS).token_ids == plain_outputs[5]


def test_the_clusters_redis_asks_for_a_password_that_no_command_line_shows(cluster):
    import redis

    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(cluster.redis.address).ping()  # any local process, without the password
    assert redis.Redis.from_url(cluster.redis_url_file.read_text().strip()).ping()
    assert cluster.redis_url_file.stat().st_mode & 0o077 == 0  # the operator's copy: this user's only
    password = cluster.redis.password
    running = [cluster.redis.process, *(p.popen for p in cluster.processes() if p.popen is not None)]
    for process in [p for p in running if p.poll() is None]:  # those the kill tests left dead are gone
        command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert password.encode() not in command_line, process.args
        assert not any(p.encode() in command_line for p in cluster.redis_passwords.values())


def test_each_service_uses_redis_as_its_own_user_with_only_its_rights(cluster):
    import redis
    from redis.exceptions import NoPermissionError

    users = {}
    for process in cluster.processes():
        environment = dict(line.split(b"=", 1) for line in
                           Path(f"/proc/{process.popen.pid}/environ").read_bytes().split(b"\0") if b"=" in line)
        url = environment[b"SPECMESH_REDIS_URL"].decode()
        users[process.name] = url.split("//", 1)[1].split(":", 1)[0]
        with redis.Redis.from_url(url) as own:
            assert own.ping()
            with pytest.raises(NoPermissionError):
                own.flushall()  # no role may empty the queue
            with pytest.raises(NoPermissionError):  # nor write what only another role writes
                if users[process.name] == "specmesh-verifier":
                    own.xadd("specmesh:default:admissions", {"admission": b"forged"})
                else:
                    own.xadd("specmesh:outputs:r", {"outputs": b"forged"})
    assert users == {p.name: f"specmesh-{p.name.split('-')[0]}" for p in cluster.processes()}


def per_token_latency(client: Client, question: str) -> float:
    """Seconds a token of one short streamed request, from its start (a wait for its first step counts)."""
    started, count = time.perf_counter(), 0
    for chunk in client.stream(chat=[("user", question)], max_tokens=MAX_TOKENS):
        count += len(chunk.token_ids)
    return (time.perf_counter() - started) / count


def test_a_long_prompt_is_prefilled_between_short_requests_steps(tmp_path, questions, plain_outputs):
    """One verifier: short requests beside the prefill of a ~1,400-token prompt keep their per-token
    latency within 2x of what it is without it; every output is plain greedy's."""
    spec = ClusterSpec(drafters=("ngram",), verifiers=1, job_timeout_s=120, log_dir=tmp_path)
    long_text = " ".join(questions)  # ~1,400 tokens
    chosen = list(range(4))
    with LocalCluster(spec) as cluster, Client(cluster.router_address) as client:
        client.generate(chat=[("user", questions[5])], max_tokens=8)  # warm-up
        with ThreadPoolExecutor(len(chosen)) as pool:
            alone = list(pool.map(lambda i: per_token_latency(client, questions[i]), chosen))
        with ThreadPoolExecutor(len(chosen) + 1) as pool:
            long = pool.submit(lambda: (client.generate(prompt=long_text, max_tokens=4), time.monotonic()))
            time.sleep(0.3)  # its prefill is under way (it takes seconds)
            started = time.monotonic()
            beside = list(pool.map(lambda i: per_token_latency(client, questions[i]), chosen))
            ended = time.monotonic()
            answer, answered = long.result(timeout=300)
        # the premise: the short requests ran beside the prefill for most of their time (it may end first)
        assert (min(answered, ended) - started) / (ended - started) > 0.5
        outputs = [client.generate(chat=[("user", questions[i])], max_tokens=MAX_TOKENS).token_ids for i in chosen]
    assert answer.usage.prompt_tokens > 1000 and len(answer.token_ids) == 4
    ratio = sorted(beside)[len(beside) // 2] / sorted(alone)[len(alone) // 2]
    assert ratio < 2.0, f"median per-token latency {ratio:.2f}x beside the long prefill ({beside} vs {alone})"
    assert outputs == [plain_outputs[i] for i in chosen]


def test_requests_outlive_a_restart_of_the_only_verifier_longer_than_the_job_timeout(tmp_path, questions,
                                                                                      plain_outputs):
    spec = ClusterSpec(drafters=("ngram",), verifiers=1, job_timeout_s=2.0, log_dir=tmp_path)
    chosen = list(range(4))
    with LocalCluster(spec) as cluster, Client(cluster.router_address) as client:
        started = threading.Barrier(len(chosen) + 1)
        with ThreadPoolExecutor(len(chosen)) as pool:
            futures = [pool.submit(stream_collect, client, questions[i], started, 1) for i in chosen]
            started.wait(timeout=120)
            killed_at, popen = time.monotonic(), cluster.verifiers[0].popen
            cluster.verifiers[0].signal(signal.SIGKILL)
            outputs = [f.result(timeout=300) for f in futures]
        assert popen.wait(5) == -signal.SIGKILL
        assert time.monotonic() - killed_at > 2 * spec.job_timeout_s, "the restart took longer than the job timeout"
    assert outputs == [plain_outputs[i] for i in chosen]
    assert "took over" in cluster.verifiers[0].log_path.read_text(), "the restarted verifier adopted its own requests"
