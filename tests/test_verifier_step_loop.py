"""The engine-core path through the launched cluster (``--step-loop verifier``): the verifier runs every
request's step loop and the router admits requests and streams their answers. The real embedded model, an
n-gram drafter in the verifier and the code expert as a drafter service.

- greedy outputs identical to plain greedy decoding (gRPC at concurrency 1 and 8, adaptive and fixed; the
  OpenAI API), and speculation happens;
- a stream the client leaves frees the request on the router and on the verifier;
- forged and unreadable admissions are dropped and counted; the verifier goes on serving;
- kill -9 of a verifier (of two) and of the drafter service during 8 streams: the other verifier adopts its
  requests from their admissions and the commit log, every output is the undisturbed one;
- the only verifier killed and back after longer than the job timeout: its requests wait and complete.
"""

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from conftest import wait_until
from test_cluster import (  # noqa: F401 (fixtures)
    MAX_TOKENS,
    generate_all,
    metric_total,
    plain_outputs,
    questions,
    stream_collect,
)

from specmesh.client import Client
from specmesh.cluster.control import call_verifier
from specmesh.cluster.launcher import ClusterSpec, LocalCluster
from specmesh.cluster.pipeline.messages import QueueKeys, QueueSigner
from specmesh.v1 import common_pb2, verifier_pb2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, plain_outputs):  # noqa: F811 (the fixture above)
    spec = ClusterSpec(drafters=("ngram", "code"), verifiers=2, step_loop="verifier", job_timeout_s=60,
                       log_dir=tmp_path_factory.mktemp("step-loop-logs"))
    with LocalCluster(spec) as running:
        yield running


def admin_redis(cluster) -> redis.Redis:
    return redis.Redis.from_url(cluster.redis_url_file.read_text().strip())


@pytest.mark.parametrize("concurrency, speculation", [(1, "adaptive"), (8, "adaptive"), (8, "fixed")])
def test_greedy_through_the_verifiers_step_loop_is_plain_greedy(cluster, questions, plain_outputs, concurrency,  # noqa: F811
                                                                 speculation):
    drafted_before = metric_total(cluster.drafters[0], "specmesh_rpc_requests_total", method="ProposeMany")
    with Client(cluster.router_address) as client:
        if speculation == "fixed":
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(lambda q: client.generate(chat=[("user", q)], max_tokens=MAX_TOKENS,
                                                                  speculation="fixed"), questions))
        else:
            results = generate_all(client, questions, concurrency)
    different = [i for i, (r, ref) in enumerate(zip(results, plain_outputs)) if r.token_ids != ref]
    assert not different, f"prompts {different} differ from plain greedy decoding"
    assert all(r.stats.target_steps > 0 and r.stats.request_kind for r in results)
    if speculation == "fixed":  # the whole budget every step: the trees are accepted in part at least
        steps, tokens = sum(r.stats.target_steps for r in results), sum(len(r.token_ids) for r in results)
        assert steps < tokens, (steps, tokens)
        assert metric_total(cluster.drafters[0], "specmesh_rpc_requests_total", method="ProposeMany") > drafted_before


def test_the_openai_api_streams_the_verifiers_answers(cluster, questions, plain_outputs):  # noqa: F811
    from openai import OpenAI
    from transformers import AutoTokenizer

    from specmesh.runtime.loading import EMBEDDED_DEFAULT, resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(EMBEDDED_DEFAULT)[0])
    with OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(model="smollm2-135m-instruct", stream=True, temperature=0,
                                                messages=[{"role": "user", "content": questions[0]}],
                                                max_tokens=MAX_TOKENS)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == tokenizer.decode(plain_outputs[0], skip_special_tokens=True)


def test_a_stream_the_client_leaves_is_freed_on_the_router_and_the_verifier(cluster, questions):  # noqa: F811
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


def test_forged_and_unreadable_admissions_are_dropped_and_the_verifier_serves_on(cluster, questions, plain_outputs):  # noqa: F811
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


def test_killing_a_verifier_and_the_drafter_loses_no_request(cluster, questions, plain_outputs):  # noqa: F811
    chosen = list(range(8))
    started = threading.Barrier(len(chosen) + 1)
    with Client(cluster.router_address) as client, ThreadPoolExecutor(len(chosen)) as pool:
        futures = [pool.submit(stream_collect, client, questions[i], started) for i in chosen]
        started.wait(timeout=120)  # every stream is under way
        signer = QueueSigner(cluster.queue_key)
        held = {v.name: call_verifier(v.address, "info", signer).get("active_sessions", 0) for v in cluster.verifiers}
        busiest = max(cluster.verifiers, key=lambda v: held[v.name])
        assert held[busiest.name] > 0, held
        victims = [busiest, cluster.drafters[0]]
        killed = [process.popen for process in victims]
        for process in victims:
            process.signal(signal.SIGKILL)
        outputs = [f.result(timeout=300) for f in futures]
        assert outputs == [plain_outputs[i] for i in chosen]
        for process, popen in zip(victims, killed):  # the supervisor starts both again
            assert popen.wait(5) == -signal.SIGKILL
            wait_until(lambda: process.popen is not popen, timeout_s=120, what=f"{process.name} restarted")
            process.wait_ready(300)
        after = client.generate(chat=[("user", questions[9])], max_tokens=MAX_TOKENS)
        assert after.token_ids == plain_outputs[9]
    log = "".join(v.log_path.read_text() for v in cluster.verifiers)
    assert "took over" in log, "a verifier adopted the killed one's requests"


def test_routers_cannot_post_outputs_nor_verifiers_admissions(cluster):
    from pathlib import Path

    from redis.exceptions import NoPermissionError

    for process in [cluster.router, *cluster.verifiers]:
        environment = dict(line.split(b"=", 1) for line in
                           Path(f"/proc/{process.popen.pid}/environ").read_bytes().split(b"\0") if b"=" in line)
        with redis.Redis.from_url(environment[b"SPECMESH_REDIS_URL"].decode()) as own:
            with pytest.raises(NoPermissionError):
                if process is cluster.router:
                    own.xadd("specmesh:outputs:r", {"outputs": b"forged"})
                else:
                    own.xadd("specmesh:default:admissions", {"admission": b"forged"})


def test_requests_outlive_a_restart_of_the_only_verifier_longer_than_the_job_timeout(tmp_path, questions,  # noqa: F811
                                                                                      plain_outputs):
    spec = ClusterSpec(drafters=("ngram",), verifiers=1, step_loop="verifier", job_timeout_s=2.0, log_dir=tmp_path)
    chosen = list(range(4))
    with LocalCluster(spec) as cluster, Client(cluster.router_address) as client:
        started = threading.Barrier(len(chosen) + 1)
        with ThreadPoolExecutor(len(chosen)) as pool:
            futures = [pool.submit(stream_collect, client, questions[i], started) for i in chosen]
            started.wait(timeout=120)
            killed_at, popen = time.monotonic(), cluster.verifiers[0].popen
            cluster.verifiers[0].signal(signal.SIGKILL)
            outputs = [f.result(timeout=300) for f in futures]
        assert popen.wait(5) == -signal.SIGKILL
        assert time.monotonic() - killed_at > 2 * spec.job_timeout_s, "the restart took longer than the job timeout"
    assert outputs == [plain_outputs[i] for i in chosen]
    assert "took over" in cluster.verifiers[0].log_path.read_text(), "the restarted verifier adopted its own requests"
