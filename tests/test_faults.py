"""Faults one at a time, on a real redis-server with in-process verifier workers (tiny model) and the
services over loopback: a poisoned queue entry, a pass longer than the heartbeat, a verifier restarted
under the same id, a request abandoned mid-step, a prefill longer than the job timeout, health that tells
the truth, malformed wire input, oversized prompts and drafter sessions."""

import asyncio
import json
import subprocess
import sys
import time

import grpc
import pytest
from cluster_parts import InProcessPool, ServiceStack, SlowVerifier, plain_greedy
from conftest import HANG_S, wait_until_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.client import AsyncClient
from specmesh.cluster.gateway import RouterLimits
from specmesh.cluster.pipeline.verifier_end import VerifierQueue
from specmesh.cluster.pipeline.messages import decode_job, encode_job
from specmesh.cluster.serving import Service, TorchThread, start_server
from specmesh.cluster.pipeline.messages import JOB
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument, NotFound
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob
from specmesh.sampling import SamplingParams
from specmesh.cluster.drafter_sessions import DrafterSessions
from specmesh.services.router.server import ROUTER_SERVICE
from specmesh.cluster.pipeline.worker import VerifierWorker
from specmesh.services.verifier.server import follow_worker
from specmesh.tree import TokenTree
from specmesh.v1 import router_pb2

PROMPT = (5, 6, 7, 5, 6)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def first_job(request_id: str, prompt=PROMPT) -> VerifyJob:
    return VerifyJob(request_id, 0, len(prompt) - 1, prompt[-1], TokenTree(), SamplingParams(max_tokens=8),
                     history=prompt[:-1])


def outcome(worker: VerifierWorker, name: str) -> float:
    return worker.metrics.registry.get_sample_value("specmesh_verify_jobs_total", {"outcome": name}) or 0


def test_a_poisoned_entry_is_acknowledged_and_the_worker_lives_on(redis_server, tiny_model):
    """A tagged job whose reply_to names a key of another type: Redis refuses the result (WRONGTYPE); the
    job is acknowledged and counted, the worker serves the next one."""
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            poison = f"specmesh:results:poison-{pool.keys.pool}"
            await pool.redis.set(poison, b"a string, not a stream")
            payload = encode_job(first_job("poisoned"), poison, 0)
            await pool.redis.xadd(pool.keys.jobs, {"job": payload, "tag": pool.signer.tag(JOB, payload)})
            worker = pool.workers[0]
            await wait_until_async(lambda: outcome(worker, "undeliverable") == 1, what="the poisoned job was counted")
            after = await asyncio.wait_for(pool.client.verify(first_job("next")), HANG_S)
            # the poisoned entry is gone from the stream too (acknowledgements follow the results they answer)
            await wait_until_async(lambda: empty(pool), what="both jobs acknowledged and deleted")
            return after, pool.tasks[0].done(), worker.unready.is_set()

    after, ended, unready = asyncio.run(main())
    assert after.verdict is not None and not ended and not unready


async def empty(pool: InProcessPool) -> bool:
    return await pool.redis.xlen(pool.keys.jobs) == 0



def test_a_job_past_its_deadline_is_acknowledged_unanswered_and_never_run(redis_server, tiny_model):
    """Its router has given up on it: the verifier drops it (counted as expired) without a pass or a
    result, and serves the next job."""
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            reply_to = f"specmesh:results:late-{pool.keys.pool}"
            payload = encode_job(first_job("late"), reply_to, int(time.time() * 1000) - 1000)
            await pool.redis.xadd(pool.keys.jobs, {"job": payload, "tag": pool.signer.tag(JOB, payload)})
            worker = pool.workers[0]
            await wait_until_async(lambda: outcome(worker, "expired") == 1, what="the late job was dropped")
            after = await asyncio.wait_for(pool.client.verify(first_job("next")), HANG_S)
            await wait_until_async(lambda: empty(pool), what="both jobs acknowledged and deleted")
            return after, await pool.redis.exists(reply_to), worker.verifier.num_sessions, outcome(worker, "ok")

    after, answered, sessions, ok = asyncio.run(main())
    assert after.verdict is not None
    assert not answered and sessions == 1 and ok == 1  # no result, no session: only "next" was run

async def held(pool: InProcessPool) -> int:
    """Pool jobs a verifier has taken and not answered yet."""
    return (await pool.redis.xpending(pool.keys.jobs, "verifiers"))["pending"]


def test_a_pass_longer_than_the_heartbeat_is_neither_resent_nor_reclaimed(redis_server, tiny_model):
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0, resend_after_s=0.3) as pool:
            slow = VerifierWorker(SlowVerifier(LlamaRuntime(tiny_model), pass_s=3.0),
                                  VerifierQueue(pool.redis, pool.keys, "slow", heartbeat_ttl_s=1.0, signer=pool.signer),
                                  TorchThread("slow"))
            pool.workers.append(slow)
            pool.tasks.append(asyncio.create_task(slow.run()))
            await wait_until_async(lambda: pool.redis.exists(pool.keys.alive("slow")), what="the slow worker beats")
            answer = asyncio.create_task(pool.client.verify(first_job("long")))
            await wait_until_async(lambda: held(pool), what="the slow worker took the job")
            other = pool.add_worker("other")  # idle beside it: it must not take the live one's job
            result = await asyncio.wait_for(answer, HANG_S)
            return (result, pool.client.affinity["long"], pool.client.resent_jobs, other.metrics.reclaimed._value.get(),
                    slow.verifier.stats.batches, other.verifier.stats.batches)

    result, verifier, resent, reclaimed, slow_passes, other_passes = asyncio.run(main())
    assert result.verdict is not None and verifier == "slow"
    assert resent == 0 and reclaimed == 0  # 3 s pass, 1 s heartbeat TTL, 0.3 s re-send check
    assert slow_passes == 1 and other_passes == 0


def test_a_verifier_restarted_under_its_id_answers_what_it_held(redis_server, tiny_model):
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0, resend_after_s=60) as pool:
            before = VerifierQueue(pool.redis, pool.keys, "v0", heartbeat_ttl_s=60, signer=pool.signer)
            await before.register()
            answer = asyncio.create_task(pool.client.verify(first_job("held")))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.jobs), what="the job is queued")
            assert len(await before.read(count=10, block_ms=100, include_pool=True)) == 1  # taken, then it "dies"
            pool.add_worker("v0")  # the same id again, as a supervisor restarts it; its heartbeat never lapsed
            return await asyncio.wait_for(answer, HANG_S), pool.client.affinity["held"], pool.client.resent_jobs

    result, verifier, resent = asyncio.run(main())
    assert result.verdict is not None and verifier == "v0" and resent == 0


def test_an_abandoned_request_frees_its_kv_cache_when_its_late_result_comes(redis_server, tiny_model):
    """Abandoned before its first result, the router does not know which verifier holds the request; the
    late result names it, and the router closes the session there (not 300 s later). (The close the router
    owes every verifier may also reach the new one with the job, which then drops it unverified.)"""
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0) as pool:
            answer = asyncio.create_task(pool.client.verify(first_job("abandoned")))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.jobs), what="the job is queued")
            answer.cancel()  # the client left ...
            await asyncio.gather(answer, return_exceptions=True)
            await pool.client.close("abandoned")  # ... and the loop's clean-up closed the request
            worker = pool.add_worker("v0")
            await wait_until_async(lambda: worker.verifier.stats.jobs + outcome(worker, "closed") == 1,
                                   what="the job was verified or dropped")
            started = time.monotonic()
            await wait_until_async(lambda: worker.verifier.num_sessions == 0, timeout_s=10,
                                   what="the abandoned request's session was closed")
            return time.monotonic() - started

    assert asyncio.run(main()) < 10


async def health_of(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=10)
        return answer.status


def test_a_drained_or_stopped_verifier_is_not_serving(redis_server, tiny_model):
    async def main():
        statuses = []
        async with InProcessPool(redis_server.url, tiny_model, workers=2) as pool:
            for worker, end in zip(pool.workers, ("drain", "stop")):
                server = await start_server([Service("specmesh.v1.Verifier", lambda s: None)], "127.0.0.1:0")
                following = asyncio.create_task(follow_worker(worker, server))
                address = f"127.0.0.1:{server.port}"
                before = await health_of(address)
                if end == "drain":
                    await worker.drain()
                else:  # the worker's loop ended with the server still up
                    worker.stopped.set()
                await asyncio.wait_for(following, HANG_S)
                statuses.append((before, await health_of(address), await health_of(address, "specmesh.v1.Verifier")))
                await server.server.stop(0)
        return statuses

    assert asyncio.run(main()) == [(SERVING, NOT_SERVING, NOT_SERVING)] * 2


async def router_serving(address: str) -> bool:
    return await health_of(address, ROUTER_SERVICE) == SERVING


async def router_not_serving(address: str) -> bool:
    return await health_of(address, ROUTER_SERVICE) == NOT_SERVING


def test_the_router_says_when_no_verifier_is_live_and_its_requests_wait_for_one(redis_server, model, tokenizer):
    """With no live verifier the Router service is NOT_SERVING (the server itself stays SERVING: requests
    are taken and wait, within their deadline, for a verifier to come back)."""
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), verifiers=0) as stack:
            await wait_until_async(lambda: router_not_serving(stack.address), what="the watch saw no verifier")
            without = (await health_of(stack.address), await health_of(stack.address, ROUTER_SERVICE))
            async with AsyncClient(stack.address) as client:
                waiting = asyncio.create_task(client.generate(prompt_ids=list(PROMPT), max_tokens=8))
                await asyncio.sleep(1.0)
                assert not waiting.done()
                await stack.add_verifier("late")
                answer = await asyncio.wait_for(waiting, HANG_S)
            await wait_until_async(lambda: router_serving(stack.address), what="the Router service is SERVING again")
            return without, answer.token_ids

    without, tokens = asyncio.run(main())
    assert without == (SERVING, NOT_SERVING)
    assert tokens == plain_greedy(model, PROMPT, 8)


def raw_string_field(number: int, data: bytes) -> bytes:
    """A length-delimited field as on the wire: tag, length, bytes (here: not UTF-8)."""
    return bytes([number << 3 | 2, len(data)]) + data


def test_malformed_wire_input_is_invalid_argument(redis_server, model, tokenizer):
    prompt_field = router_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].number
    bad = {
        "truncated": b"\x0a\xff\x01",  # a length past the end
        "invalid UTF-8": raw_string_field(prompt_field, b"\xff\xfe\xfd"),
    }

    async def main():
        codes = {}
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with grpc.aio.insecure_channel(stack.address) as channel:
                for method in ("/specmesh.v1.Router/Generate", "/specmesh.v1.Router/GenerateStream",
                               "/specmesh.v1.Router/CountTokens", "/grpc.health.v1.Health/Check"):
                    for name, payload in bad.items():
                        call = (channel.unary_stream if method.endswith("Stream") else channel.unary_unary)(method)
                        try:
                            answer = call(payload, timeout=10)
                            if method.endswith("Stream"):
                                [_ async for _ in answer]
                            else:
                                await answer
                            codes[method, name] = ("OK", "")
                        except grpc.aio.AioRpcError as exc:
                            codes[method, name] = (exc.code(), exc.details())
            async with AsyncClient(stack.address) as client:
                with pytest.raises(grpc.aio.AioRpcError) as negative:
                    await client.generate(prompt_ids=[5, -3, 7], max_tokens=2)
                ok = await client.generate(prompt_ids=list(PROMPT), max_tokens=3)  # nothing crashed
        return codes, (negative.value.code(), negative.value.details()), ok

    codes, negative, ok = asyncio.run(main())
    for (method, name), (code, details) in codes.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, name, code, details)
        assert "request" in details and "Error" not in details.split(":")[0], details
    assert negative[0] == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in negative[1]
    assert len(ok.token_ids) == 3


def test_a_16_mb_prompt_is_refused_at_once_and_the_router_answers_meanwhile(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with AsyncClient(stack.address) as client:
                started = time.monotonic()
                huge = asyncio.create_task(client.generate(prompt="word " * ((16 << 20) // 5), max_tokens=2))
                health = []
                while not huge.done():  # the event loop answers probes while the prompt is read
                    at = time.monotonic()
                    health.append((await health_of(stack.address), time.monotonic() - at))
                    await asyncio.sleep(0.05)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await huge
                refused_after = time.monotonic() - started
                # a long prompt that fits: tokenized on the router's input thread
                long = await client.count_tokens(prompt="word " * 3_000)
        return err.value, refused_after, health, long

    err, refused_after, health, long = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.details() and "characters" in err.details()
    assert refused_after < 10  # sending 16 MB over loopback, then one length check
    assert all(status == SERVING and seconds < 5.0 for status, seconds in health)  # (none, if refused at once)
    assert 3_000 <= long <= 3_001  # "word" and " word" tokens (and a trailing space)


def test_drafter_sessions_stay_within_the_context_the_count_and_the_token_budget():
    sessions = DrafterSessions(NgramDrafter(), vocab_size=100, max_sessions=3, max_session_tokens=10,
                               max_total_tokens=20)
    with pytest.raises(InvalidArgument, match="prompt_ids"):
        sessions.open("long", list(range(11)))
    sessions.open("a", list(range(8)))
    sessions.propose("a", [1, 2], budget=4)  # 10 tokens: the limit
    with pytest.raises(InvalidArgument, match="committed"):
        sessions.propose("a", [3], budget=4)
    sessions.open("b", list(range(6)))
    sessions.open("c", list(range(5)))  # 21 tokens in all: "a", the least recently used, ends
    assert len(sessions) == 2 and sessions.total_tokens == 11
    with pytest.raises(NotFound):
        sessions.propose("a", [], budget=4)
    sessions.propose("b", [7], budget=4)
    sessions.open("d", [1])
    sessions.open("e", [1])  # past max_sessions: "c" ends ("b" was used after it)
    assert len(sessions) == 3 and sessions.total_tokens == 9
    sessions.close("b", [4, 5])
    assert len(sessions) == 2 and sessions.total_tokens == 2
    assert sessions.trim(now=100.0) and not sessions.trim(now=101.0)  # sessions ended: once, then not so soon


def test_a_drafter_session_opened_after_its_close_is_not_held():
    """A client that leaves at once: the router's close of its request can run before the open it sent
    first (two calls, no order between them); that open opens nothing."""
    sessions = DrafterSessions(NgramDrafter(), vocab_size=100, max_sessions=8)
    sessions.close("left", [])
    sessions.open("left", [1, 2, 3])
    assert len(sessions) == 0 and sessions.total_tokens == 0
    sessions.open("other", [1, 2, 3])  # others open as ever
    assert len(sessions) == 1


def test_drafter_sessions_unused_for_long_end_as_their_router_is_gone():
    now = [0.0]
    sessions = DrafterSessions(NgramDrafter(), vocab_size=100, max_sessions=8, clock=lambda: now[0])
    sessions.open("gone", [1, 2, 3])
    sessions.open("live", [1, 2, 3])
    now[0] = 30.0
    assert sessions.end_idle(60.0) == 0
    sessions.propose("live", [4], budget=2)  # drafted for since: it stays
    now[0] = 61.0
    assert sessions.end_idle(60.0) == 1 and len(sessions) == 1
    with pytest.raises(NotFound):  # a router that does come back re-opens it
        sessions.propose("gone", [4], budget=2)
    sessions.propose("live", [5], budget=2)


MEMORY_PROBE = """
import gc, json, random, time, psutil
from specmesh.drafters.ngram import NgramDrafter
from specmesh.cluster.drafter_sessions import DrafterSessions
process, rng = psutil.Process(), random.Random(0)
sessions = DrafterSessions(NgramDrafter(), vocab_size=49152, max_sessions=1000, max_session_tokens=2000,
                           max_total_tokens=2_000_000)
before = process.memory_info().rss
for i in range(1000):
    sessions.open(f"r{i}", [rng.randrange(49152) for _ in range(2000)])
held = process.memory_info().rss
for i in range(1000):
    sessions.close(f"r{i}", [])
gc.collect()
sessions.trim(time.monotonic() + 3600)
print(json.dumps([before, held, process.memory_info().rss]))
"""


def test_memory_of_closed_drafter_sessions_goes_back_to_the_system():
    """1,000 sessions of 2,000 tokens in prompt lookup's index, then closed: the process's RSS comes back
    to within 100 MB of where it was (it kept ~700 MB of freed blocks before the heap was trimmed). In a
    process of its own: what this one freed before would blur it."""
    answer = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=300)
    assert answer.returncode == 0, answer.stderr
    before, held, after = json.loads(answer.stdout.strip().splitlines()[-1])
    assert held - before > 500 << 20  # the sessions did hold memory
    assert after - before < 100 << 20, f"{(after - before) >> 20} MB not given back"


def test_a_long_prefill_is_chunked_between_other_requests_steps(redis_server, tiny_model):
    """The worker caches a long history a chunk per pass; a short request's steps are verified in those
    passes (not after the whole prefill), and nothing is re-sent."""
    history = tuple(3 + (i * 7) % 90 for i in range(480))
    long = VerifyJob("long", 0, len(history), 5, TokenTree.chain([6, 7]), SamplingParams(max_tokens=8), history)
    whole = TreeVerifier(LlamaRuntime(tiny_model)).verify([long])[0]

    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1, resend_after_s=0.3) as pool:
            answer = asyncio.create_task(pool.client.verify(long))
            short_steps, step = 0, first_job("short")
            while not answer.done():
                result = await asyncio.wait_for(pool.client.verify(step), HANG_S)
                short_steps += 1
                position = step.position + 1 + len(result.verdict.accepted_nodes)
                step = VerifyJob("short", step.step + 1, position, result.verdict.tokens[-1], TokenTree(),
                                 SamplingParams(max_tokens=8))
            return await answer, short_steps, pool.client.resent_jobs

    result, short_steps, resent = asyncio.run(main())
    assert result.verdict == whole.verdict and result.prefilled_tokens == len(history)
    assert short_steps >= 2 and resent == 0


def test_a_new_request_is_not_kept_out_of_a_pass_by_a_prefill_that_had_the_verifier_to_itself(redis_server, tiny_model):
    """A long prefill alone grows its chunks to fill whole passes; a short request arriving then is verified in
    the next pass (the prefill still under way, it takes the rows the short one leaves), not after the prefill."""
    history = tuple(3 + (i * 7) % 90 for i in range(480))
    long = VerifyJob("long", 0, len(history), 5, TokenTree.chain([6, 7]), SamplingParams(max_tokens=8), history)
    whole = TreeVerifier(LlamaRuntime(tiny_model)).verify([long])[0]

    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            worker = pool.workers[0]
            worker.verifier = SlowVerifier(LlamaRuntime(tiny_model), pass_s=0.3)  # chunks of 64, 128, 256, 32 tokens
            worker.max_batch_rows = 100  # the second chunk on is more than a pass holds
            answer = asyncio.create_task(pool.client.verify(long))
            await wait_until_async(lambda: worker.verifier.resuming(long), what="the prefill's first chunk")
            short = await asyncio.wait_for(pool.client.verify(first_job("short")), HANG_S)
            return short, worker.verifier.resuming(long), await answer

    short, long_under_way, result = asyncio.run(main())
    assert short.verdict is not None and long_under_way
    assert result.verdict == whole.verdict and result.prefilled_tokens == len(history)


def test_a_prefill_longer_than_the_job_timeout_goes_on_while_it_reports_progress(redis_server, tiny_model):
    """A prefill of ~3 s under a 2 s job timeout is answered (its verifier reports progress, and the
    router waits); the same prefill abandoned halfway is stopped there and its session freed."""
    history = tuple(3 + (i * 7) % 90 for i in range(480))

    def long(request_id: str) -> VerifyJob:
        return VerifyJob(request_id, 0, len(history), 5, TokenTree.chain([6, 7]), SamplingParams(max_tokens=8), history)

    whole = TreeVerifier(LlamaRuntime(tiny_model)).verify([long("whole")])[0]

    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1, job_timeout_s=2.0, resend_after_s=0.3) as pool:
            worker = pool.workers[0]
            worker.verifier = SlowVerifier(LlamaRuntime(tiny_model), pass_s=0.8)  # 4 chunks (64 to 256 tokens), 0.8 s each
            started = time.monotonic()
            result = await asyncio.wait_for(pool.client.verify(long("kept")), HANG_S)
            took = time.monotonic() - started

            left = asyncio.create_task(pool.client.verify(long("left")))
            await asyncio.sleep(1.2)  # two passes of its prefill are done or under way
            left.cancel()
            await pool.client.close("left")
            await wait_until_async(lambda: outcome(worker, "closed") == 1, what="the abandoned prefill stopped")
            await wait_until_async(lambda: worker.verifier.num_sessions == 1, what="its session freed")
            return result, took, outcome(worker, "ok"), pool.client.resent_jobs

    result, took, ok, resent = asyncio.run(main())
    assert took > 2.0 and result.verdict == whole.verdict and result.prefilled_tokens == len(history)
    assert ok == 1 and resent == 0  # the abandoned one was never verified


def test_without_a_verifier_requests_wait_in_a_bounded_queue_then_fail_cleanly(redis_server, model, tokenizer):
    """No verifier: requests are taken and wait for one; past the pool's backlog limit new ones are refused
    RESOURCE_EXHAUSTED; one that waits past the job timeout fails UNAVAILABLE (never hangs); when a
    verifier comes the waiting ones complete."""
    limits = RouterLimits(max_tree_nodes=0, max_queue_backlog=2, speculation="off")

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), limits, verifiers=0,
                                step_loop="router") as stack:
            async with AsyncClient(stack.address, retries=0) as client:
                waiting = [asyncio.create_task(client.generate(prompt_ids=[5 + i, 6, 7], max_tokens=4)) for i in range(2)]
                await wait_until_async(lambda: backlog_is(stack, 2), what="two jobs wait")
                stack.pool.client.job_timeout_s = 1.0  # for the next request only (the others posted theirs)
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await asyncio.wait_for(client.generate(prompt_ids=[8, 8], max_tokens=4), HANG_S)
                waited = time.monotonic() - started
                stack.pool.client.job_timeout_s = 30.0
                # its job is still queued (a verifier drops it as expired): 3 > 2, the queue is full
                with pytest.raises(grpc.aio.AioRpcError) as full:
                    await client.generate(prompt_ids=[9, 9, 9], max_tokens=4)
                stack.pool.add_worker("late")
                answers = await asyncio.wait_for(asyncio.gather(*waiting), HANG_S)
        return full.value, late.value, waited, answers

    full, late, waited, answers = asyncio.run(main())
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in full.details()
    assert late.code() == grpc.StatusCode.UNAVAILABLE and "no verifier answered" in late.details() and waited < 30
    assert [a.token_ids for a in answers] == [plain_greedy(model, [5 + i, 6, 7], 4) for i in range(2)]


def test_without_a_verifier_admissions_wait_in_a_bounded_queue_past_the_timeout_until_one_comes(redis_server, model,
                                                                                                tokenizer):
    """The engine path with no verifier yet: requests are admitted and wait; past the pool's backlog limit new
    ones are refused RESOURCE_EXHAUSTED; the admitted ones outlive the router's timeout (they wait in Redis,
    as for a restarting verifier) and complete when a verifier comes."""
    limits = RouterLimits(max_tree_nodes=0, max_queue_backlog=2, speculation="off")

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), limits, verifiers=0) as stack:
            stack.pool.client.timeout_s = 0.5
            async with AsyncClient(stack.address, retries=0) as client:
                waiting = [asyncio.create_task(client.generate(prompt_ids=[5 + i, 6, 7], max_tokens=4)) for i in range(3)]
                await wait_until_async(lambda: admissions_are(stack, 3), what="three admissions wait")
                with pytest.raises(grpc.aio.AioRpcError) as full:
                    await client.generate(prompt_ids=[9, 9, 9], max_tokens=4)
                await asyncio.sleep(1.5)  # three timeouts
                assert not any(w.done() for w in waiting)
                await stack.add_verifier("late")
                answers = await asyncio.wait_for(asyncio.gather(*waiting), HANG_S)
        return full.value, answers

    full, answers = asyncio.run(main())
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in full.details()
    assert [a.token_ids for a in answers] == [plain_greedy(model, [5 + i, 6, 7], 4) for i in range(3)]


async def admissions_are(stack: ServiceStack, count: int) -> bool:
    return await stack.pool.client.backlog() == count


async def backlog_is(stack: ServiceStack, count: int) -> bool:
    return await stack.pool.redis.xlen(stack.pool.keys.jobs) == count


def test_a_verifier_reads_all_it_holds_again_a_page_at_a_time(redis_server):
    async def main():
        import redis.asyncio as aioredis

        from specmesh.cluster.pipeline.messages import QueueKeys
        from specmesh.cluster.pipeline.messages import QueueSigner, new_key

        client = aioredis.Redis.from_url(redis_server.url)
        signer = QueueSigner(new_key())
        queue = VerifierQueue(client, QueueKeys(pool="paged"), "v0", signer=signer)
        await queue.register()
        payload = encode_job(first_job("x"), "specmesh:results:r", 0)
        for _ in range(300):
            await client.xadd(queue.keys.jobs, {"job": payload, "tag": signer.tag(JOB, payload)})
        taken = 0
        while read := await queue.read(count=100, block_ms=10, include_pool=True):  # taken, not answered
            taken += len(read)
        again = await queue.held_before()
        await client.aclose()
        return taken, len(again), len({e.entry_id for e in again})

    assert asyncio.run(main()) == (300, 300, 300)


def test_only_one_verifier_claims_a_dead_ones_job(redis_server):
    async def main():
        import redis.asyncio as aioredis

        from specmesh.cluster.pipeline.messages import QueueKeys
        from specmesh.cluster.pipeline.messages import QueueSigner, new_key

        client, keys, signer = aioredis.Redis.from_url(redis_server.url), QueueKeys(pool="claims"), QueueSigner(new_key())
        ghost, a, b = (VerifierQueue(client, keys, name, heartbeat_ttl_s=0.3, signer=signer) for name in ("ghost", "a", "b"))
        for queue in (ghost, a, b):
            await queue.register()
        payload = encode_job(first_job("x"), "specmesh:results:r", 0)
        await client.xadd(keys.jobs, {"job": payload, "tag": signer.tag(JOB, payload)})
        assert len(await ghost.read(count=10, block_ms=10, include_pool=True)) == 1
        await wait_until_async(lambda: dead(client, keys.alive("ghost")), what="the ghost's heartbeat expired")
        await asyncio.sleep(0.2)  # idle past a third of the TTL
        first, second = await a.reclaim(), await b.reclaim()
        await client.aclose()
        return len(first), len(second)

    assert asyncio.run(main()) == (1, 0)


async def dead(client, key: str) -> bool:
    return not await client.exists(key)


def test_a_job_for_a_verifier_whose_stream_is_gone_goes_to_the_pool(redis_server, tiny_model):
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            pool.client.affinity["moved"] = "gone"  # its verifier died and another adopted (deleted) its stream
            pool.client.alive.add("gone")  # the router has not noticed yet
            result = await asyncio.wait_for(pool.client.verify(first_job("moved")), HANG_S)
            return result, await pool.redis.exists(pool.keys.own_jobs("gone"))

    result, recreated = asyncio.run(main())
    assert result.verdict is not None and not recreated


def test_a_second_answer_from_another_verifier_has_its_session_closed(redis_server, tiny_model):
    """The same job taken by two verifiers (a claim while its first holder was still at it): the router
    takes the first answer and closes the session the second opened."""
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=2) as pool:
            job = first_job("twice")
            pool.client.affinity["twice"] = "v0"  # posted to v0's own stream, a copy to v1's
            payload = encode_job(job, pool.client.reply_to, 0)
            await pool.redis.xadd(pool.keys.own_jobs("v1"), {"job": payload, "tag": pool.signer.tag(JOB, payload)})
            await asyncio.wait_for(pool.client.verify(job), HANG_S)
            await wait_until_async(lambda: sum(w.verifier.stats.jobs for w in pool.workers) == 2,
                                   what="both copies were verified")
            await wait_until_async(lambda: sum(w.verifier.num_sessions for w in pool.workers) == 1,
                                   timeout_s=10, what="the second session was closed")
            return [w.verifier.num_sessions for w in pool.workers], pool.client.affinity["twice"]

    sessions, holder = asyncio.run(main())
    assert sorted(sessions) == [0, 1] and holder in ("v0", "v1")


def test_a_verifier_that_stood_still_past_its_heartbeat_drops_its_stale_sessions(redis_server, tiny_model):
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            worker = pool.workers[0]
            await asyncio.wait_for(pool.client.verify(first_job("stale")), HANG_S)
            assert worker.verifier.num_sessions == 1
            time.sleep(1.5)  # the whole process stands still (a SIGSTOP, a stall) past the 1 s TTL
            await wait_until_async(lambda: worker.verifier.num_sessions == 0, timeout_s=10,
                                   what="the stale session was dropped")
            after = await asyncio.wait_for(pool.client.verify(first_job("after")), HANG_S)
            return after

    assert asyncio.run(main()).verdict is not None


def test_a_close_redis_could_not_take_is_sent_again_once_it_is_back(restartable_redis, tiny_model):
    """A request ends while Redis is down (or restarted empty, before its verifier registered again): the
    close is owed, and sent when the verifier is alive again, so the KV cache is freed in seconds, not at
    the 300 s idle eviction."""
    server = restartable_redis

    async def main():
        async with InProcessPool(server.url, tiny_model, workers=1) as pool:
            worker = pool.workers[0]
            await asyncio.wait_for(pool.client.verify(first_job("ended")), HANG_S)
            assert worker.verifier.num_sessions == 1
            server.stop()
            await pool.client.close("ended")  # Redis cannot take it
            server.start()  # empty: the worker registers again, its heartbeat makes it alive to the router
            await wait_until_async(lambda: worker.verifier.num_sessions == 0, timeout_s=15,
                                   what="the owed close reached the verifier")
            return len(pool.client._owed)

    assert asyncio.run(main()) == 0


def test_bursts_after_redis_was_killed_and_restarted_all_succeed(restartable_redis, model, tokenizer):
    """Redis killed (-9) and started again, empty, on its port: every pooled connection of the router and the
    verifier died with it. Once Redis answers, 3 bursts of 60 requests all succeed, with no retry by the
    client: each dead connection is replaced on its first command (11 of 60 failed with 503 before)."""
    server, burst_size = restartable_redis, 60
    chat = [("user", "Count: one two three")]

    async def main():
        limits = RouterLimits(max_concurrent_requests=burst_size, max_tree_nodes=6, speculation="fixed")
        async with ServiceStack(server.url, model, tokenizer, NgramDrafter(), limits) as stack:
            async with AsyncClient(stack.address, retries=0) as client:
                async def burst():
                    answers = await asyncio.gather(*(client.generate(chat=chat, max_tokens=4)
                                                     for _ in range(burst_size)), return_exceptions=True)
                    return [f"{a.code().name}: {a.details()}" for a in answers if isinstance(a, Exception)]

                before = await burst()  # the pools hold many connections now
                server.process.kill()
                server.process.wait()
                server.start()
                return before, [await burst() for _ in range(3)]

    before, after = asyncio.run(main())
    assert before == [] and after == [[], [], []], after


def test_a_job_posted_after_a_close_of_its_request_is_verified_even_when_read_together(redis_server, tiny_model):
    """A close (the request left this verifier) and a later job of the same request (it came back) in one
    read: only jobs posted before the close are dropped."""
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0, resend_after_s=60) as pool:
            worker = pool.worker("v0")
            await worker.queue.register()
            await pool.client._close_on("v0", "back")
            answer = asyncio.create_task(pool.client.verify(first_job("back")))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.jobs), what="the job is queued")
            pool.workers.append(worker)
            pool.tasks.append(asyncio.create_task(worker.run()))
            result = await asyncio.wait_for(answer, 10)
            return result, outcome(worker, "closed"), pool.client.resent_jobs

    result, dropped, resent = asyncio.run(main())
    assert result.verdict is not None and dropped == 0 and resent == 0


@pytest.mark.parametrize("round_s", [0.1, 5.0], ids=["restart-seen-down", "restart-within-a-round"])
def test_a_close_redis_lost_unread_is_sent_again(restartable_redis, tiny_model, round_s):
    """A request ends, its close is posted, and Redis restarts empty before its verifier (busy with a
    pass) read it: the router posts the close again once Redis is back, also when the restart was too
    quick for its liveness round to find Redis down."""
    server = restartable_redis

    async def main():
        async with InProcessPool(server.url, tiny_model, workers=1, liveness_every_s=round_s) as pool:
            worker = pool.workers[0]
            worker.verifier = SlowVerifier(LlamaRuntime(tiny_model), pass_s=0.0)
            await asyncio.wait_for(pool.client.verify(first_job("ended")), HANG_S)
            worker.verifier.pass_s = 1.5
            busy = asyncio.create_task(pool.client.verify(first_job("busy")))
            await wait_until_async(lambda: held(pool), what="the busy job's pass began")
            await pool.client.close("ended")  # posted; read only after that pass
            server.stop()
            server.start()
            await wait_until_async(lambda: "ended" not in worker.verifier._sessions, timeout_s=15,
                                   what="the close posted again reached the verifier")
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)

    asyncio.run(main())


def test_sessions_that_lost_copies_opened_are_closed_once_the_request_is_answered_or_let_go(redis_server, tiny_model):
    """A verifier verified a copy of a pool job and Redis then lost the entry (restarted empty): the router
    never hears of that session. Once the job is answered elsewhere, or its request let go, every other
    live verifier is told to close it (not 300 s later at the idle eviction)."""
    async def lose(pool: InProcessPool, job: VerifyJob, orphaned: VerifierWorker) -> asyncio.Task:
        async def queued() -> list[bytes]:
            return [entry_id for entry_id, fields in await pool.redis.xrange(pool.keys.jobs)
                    if decode_job(fields[b"job"]).job.request_id == job.request_id]

        answer = asyncio.create_task(pool.client.verify(job))
        await wait_until_async(queued, what="the job is queued")
        orphaned.verifier.verify([job])  # taken and verified there; then the entry and the answer are gone
        await pool.redis.xdel(pool.keys.jobs, *await queued())
        return answer

    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0, resend_after_s=0.3) as pool:
            orphaned = pool.worker("v0")  # not reading yet: it cannot take the copies posted again
            let_go = await lose(pool, first_job("let go"), orphaned)
            let_go.cancel()  # unanswered
            await asyncio.gather(let_go, return_exceptions=True)
            await pool.client.close("let go")
            answered = await lose(pool, first_job("answered"), orphaned)
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.jobs), what="the lost job was posted again")
            other = pool.add_worker("v1")
            result = await asyncio.wait_for(answered, HANG_S)
            assert orphaned.verifier.num_sessions == 2
            pool.workers.append(orphaned)
            pool.tasks.append(asyncio.create_task(orphaned.run()))
            await wait_until_async(lambda: orphaned.verifier.num_sessions == 0, timeout_s=10,
                                   what="the closes reached the verifier that held the lost copies")
            await wait_until_async(lambda: list(other.verifier._sessions) == ["answered"], timeout_s=10,
                                   what="the answering verifier holds the request, and only it")
            return result, pool.client.affinity["answered"]

    result, holder = asyncio.run(main())
    assert result.verdict is not None and holder == "v1"


def test_a_step_no_one_answers_fails_and_its_log_line_says_where_its_job_is(redis_server, tiny_model, caplog):
    """The client hears that no verifier answered (not the queue's internals: stream names, request ids);
    the router's log says where the job is."""
    from specmesh.errors import Unavailable

    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0, job_timeout_s=2.0) as pool:
            holder = VerifierQueue(pool.redis, pool.keys, "v0", heartbeat_ttl_s=60, signer=pool.signer)
            await holder.register()  # alive for a minute, and it never answers
            answer = asyncio.create_task(pool.client.verify(first_job("stuck")))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.jobs), what="the job is queued")
            await holder.read(count=10, block_ms=100, include_pool=True)
            with pytest.raises(Unavailable) as caught:
                await asyncio.wait_for(answer, HANG_S)
            return str(caught.value)

    with caplog.at_level("WARNING", logger="specmesh.cluster.pipeline"):
        message = asyncio.run(main())
    assert "no verifier answered step 0 within 2 s" in message and "stuck" not in message, message
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "held by v0 for" in logged and "delivered 1 time(s)" in logged, logged
