"""Faults one at a time, on a real redis-server with in-process engine nodes (tiny model) and the services
over loopback: health that tells the truth, a verifier pool that is empty or lost a request, two verifiers
adopting the same dead one's request, malformed wire input, oversized prompts and drafter sessions.
(More faults of the pipeline itself: test_engine_faults.py.)"""

import asyncio
import json
import subprocess
import sys
import time

import grpc
import pytest
from cluster_parts import EnginePool, ServiceStack, plain_greedy
from conftest import HANG_S, wait_until_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.client import AsyncClient
from specmesh.cluster.gateway import GatewayLimits
from specmesh.cluster.pipeline.messages import GROUP
from specmesh.cluster.serving import Service, start_server
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument, NotFound, Unavailable
from specmesh.sampling import SamplingParams
from specmesh.cluster.drafter_sessions import DrafterSessions
from specmesh.services.router.server import ROUTER_SERVICE
from specmesh.services.verifier.server import follow_worker
from specmesh.speculation.requests import Request
from specmesh.v1 import router_pb2, verifier_pb2

PROMPT = (5, 6, 7, 5, 6)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def health_of(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=10)
        return answer.status


def test_a_drained_or_stopped_verifier_is_not_serving(redis_server, tiny_model):
    async def main():
        statuses = []
        async with EnginePool(redis_server.url, tiny_model, workers=2) as pool:
            for node, end in zip(pool.nodes, ("drain", "stop")):  # the server on the worker's loop, as in serve()
                server = node.call(start_server([Service("specmesh.v1.Verifier", lambda s: None)], "127.0.0.1:0"))
                following = asyncio.run_coroutine_threadsafe(follow_worker(node.worker, server), node.loop)
                address = f"127.0.0.1:{server.port}"
                before = await health_of(address)
                if end == "drain":
                    await asyncio.to_thread(node.call, node.worker.drain())
                else:  # the worker's loop ended with the server still up
                    node.loop.call_soon_threadsafe(node.worker.stopped.set)
                await asyncio.wait_for(asyncio.wrap_future(following), HANG_S)
                statuses.append((before, await health_of(address), await health_of(address, "specmesh.v1.Verifier")))
                await asyncio.to_thread(node.call, server.server.stop(0))
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
    sessions.propose(f"r{i}", [], 4)  # drafted for: its tokens indexed
held = process.memory_info().rss
for i in range(1000):
    sessions.close(f"r{i}", [])
gc.collect()
sessions.trim(time.monotonic() + 3600)
print(json.dumps([before, held, process.memory_info().rss]))
"""


def test_memory_of_closed_drafter_sessions_goes_back_to_the_system():
    """1,000 sessions of 2,000 tokens in prompt lookup's index (each drafted for), then closed: the process's
    RSS comes back to within 100 MB of where it was (it kept ~700 MB of freed blocks before the heap was
    trimmed). In a process of its own: what this one freed before would blur it."""
    answer = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=300)
    assert answer.returncode == 0, answer.stderr
    before, held, after = json.loads(answer.stdout.strip().splitlines()[-1])
    assert held - before > 500 << 20  # the sessions did hold memory
    assert after - before < 100 << 20, f"{(after - before) >> 20} MB not given back"


def test_without_a_verifier_admissions_wait_in_a_bounded_queue_past_the_timeout_until_one_comes(redis_server, model,
                                                                                                tokenizer):
    """The engine path with no verifier yet: requests are admitted and wait; past the pool's backlog limit new
    ones are refused RESOURCE_EXHAUSTED; the admitted ones outlive the router's timeout (they wait in Redis,
    as for a restarting verifier) and complete when a verifier comes."""
    limits = GatewayLimits(max_tree_nodes=0, max_queue_backlog=2, speculation="off")

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


def test_a_request_whose_admission_redis_lost_fails_unavailable_after_the_timeout(redis_server, tiny_model):
    """An admission gone from the stream unanswered (a Redis that lost it): once the router's timeout passes
    without a word it fails UNAVAILABLE, saying no verifier answered (not the queue's internals), never hangs."""
    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0, timeout_s=1.0) as pool:
            answer = asyncio.create_task(pool.answer(Request(PROMPT, SamplingParams(max_tokens=8), "lost")))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.admissions), what="admitted")
            ((entry_id, _),) = await pool.redis.xrange(pool.keys.admissions)
            await pool.redis.xdel(pool.keys.admissions, entry_id)
            started = time.monotonic()
            with pytest.raises(Unavailable) as caught:
                await asyncio.wait_for(answer, HANG_S)
            return str(caught.value), time.monotonic() - started

    message, waited = asyncio.run(main())
    assert "no verifier answered" in message and "lost" not in message and "specmesh:" not in message, message
    assert waited < 5


def test_of_two_verifiers_adopting_a_dead_ones_request_one_serves_it(redis_server, tiny_model):
    """A verifier that took an admission and died (no heartbeat, no commit log) has it claimed by the two
    others looking after the pool at once: one of them serves the whole answer, the other never posts."""
    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0) as pool:
            answer = asyncio.create_task(pool.answer(Request(PROMPT, SamplingParams(max_tokens=24), "orphan")))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.admissions), what="admitted")
            await pool.redis.xgroup_create(pool.keys.admissions, GROUP, id="0", mkstream=True)
            taken = await pool.redis.xreadgroup(GROUP, "ghost", {pool.keys.admissions: ">"}, count=1)
            assert taken and taken[0][1], "the ghost took the admission"
            await pool.redis.sadd(pool.keys.members, "ghost")  # a member whose heartbeat stopped
            await asyncio.gather(pool.add_node("a"), pool.add_node("b"))
            tokens = await asyncio.wait_for(answer, HANG_S)
            posted = set()
            for _, fields in await pool.redis.xrange(pool.client.outputs):
                message = verifier_pb2.StepOutputs.FromString(fields[b"outputs"])
                posted |= {message.verifier_id for d in message.deltas if d.request_id == "orphan" and d.tokens}
            return tokens, posted, sum(n.worker.metrics.reclaimed._value.get() for n in pool.nodes)

    tokens, posted, reclaimed = asyncio.run(main())
    assert tokens == plain_greedy(tiny_model, PROMPT, 24)
    assert len(posted) == 1 and reclaimed == 1, (posted, reclaimed)


def test_bursts_after_redis_was_killed_and_restarted_all_succeed(restartable_redis, model, tokenizer):
    """Redis killed (-9) and started again, empty, on its port: every pooled connection of the router and the
    verifier died with it. Once Redis answers, 3 bursts of 60 requests all succeed, with no retry by the
    client: each dead connection is replaced on its first command (11 of 60 failed with 503 before)."""
    server, burst_size = restartable_redis, 60
    chat = [("user", "Count: one two three")]

    async def main():
        limits = GatewayLimits(max_concurrent=burst_size, max_tree_nodes=6, speculation="fixed")
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


