"""Faults on the pipeline, one at a time: engine workers on threads of
their own (tiny model, real Redis) and a router's ``EngineClient``."""

import asyncio
import logging
import threading
import time

from cluster_parts import EnginePool, SlowVerifier, plain_greedy
from conftest import HANG_S, wait_until_async

from specmesh.cluster.pipeline.messages import ADMISSION, OUTPUTS
from specmesh.runtime.tree_verifier import TreeVerifier
from specmesh.sampling import SamplingParams
from specmesh.speculation.requests import Request
from specmesh.v1 import common_pb2, verifier_pb2

PROMPT = (5, 6, 7, 5, 6, 7, 5)


async def deltas_by_verifier(pool: EnginePool, request_id: str) -> list[str]:
    """Which verifier posted each of the request's deltas, in the order the router's stream has them."""
    posted = []
    for _, fields in await pool.redis.xrange(pool.client.outputs):
        assert pool.signer.valid(OUTPUTS, fields[b"outputs"], fields[b"tag"])
        message = verifier_pb2.StepOutputs.FromString(fields[b"outputs"])
        posted += [message.verifier_id for d in message.deltas if d.request_id == request_id and d.tokens]
    return posted


def test_a_verifier_that_stood_still_past_its_heartbeat_posts_nothing_for_what_another_adopted(
        redis_server, tiny_model, caplog):
    caplog.set_level(logging.INFO, "specmesh.cluster.pipeline.engine_worker")
    request = Request(PROMPT, SamplingParams(max_tokens=400), "stalled")
    expected = plain_greedy(tiny_model, PROMPT, 400)

    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=2) as pool:
            stalled = []

            def on_delta(delta):
                if not stalled:  # the holder stands still past its 1 s heartbeat; the other adopts (its key
                    # lapses <= 1 s after the last beat, then <= ADOPT_EVERY_S until the other looks: 2 s, and margin)
                    holder = next(node for node in pool.nodes if node.holds("stalled"))
                    holder.stall(3.5)
                    stalled.append(holder.name)

            answer = await asyncio.wait_for(pool.answer(request, on_delta=on_delta), HANG_S)
            await wait_until_async(lambda: sum(node.sessions for node in pool.nodes) == 0, timeout_s=10,
                                   what="both verifiers free the request's cache")
            return answer, stalled[0], await deltas_by_verifier(pool, "stalled")

    answer, holder, posted = asyncio.run(main())
    assert answer == expected
    adopter = next((i for i, name in enumerate(posted) if name != holder), None)
    assert adopter is not None, f"the other verifier adopted the request: {posted}"
    assert holder not in posted[adopter:], f"the stalled verifier posted after the adoption: {posted}"
    assert "stood still past its heartbeat" in caplog.text


def jobs(node, outcome: str) -> float:
    return node.worker.metrics.registry.get_sample_value("specmesh_verify_jobs_total", {"outcome": outcome}) or 0


def test_forged_and_unreadable_admissions_are_dropped_and_counted_and_the_verifier_serves_on(redis_server, tiny_model):
    admission = verifier_pb2.Admission(request_id="forged", prompt=common_pb2.TokenIds(ids=list(PROMPT)),
                                       sampling=common_pb2.SamplingParams(max_tokens=4), reply_to="specmesh:outputs:x")
    payload = admission.SerializeToString()

    async def main():
        async with EnginePool(redis_server.url, tiny_model) as pool:
            node, admissions = pool.nodes[0], pool.keys.admissions
            await pool.redis.xadd(admissions, {"admission": payload, "tag": b"\x00" * 32})  # a wrong tag
            await pool.redis.xadd(admissions, {"admission": payload})  # none
            await pool.redis.xadd(admissions, {"admission": b"\xff\xfe", "tag": pool.signer.tag(ADMISSION, b"\xff\xfe")})
            unsigned_to = admission.__class__(request_id="elsewhere", reply_to="somewhere:else").SerializeToString()
            await pool.redis.xadd(admissions, {"admission": unsigned_to, "tag": pool.signer.tag(ADMISSION, unsigned_to)})
            await wait_until_async(lambda: jobs(node, "forged") == 2 and jobs(node, "error") == 2,
                                   what="the forged and unreadable admissions are counted")
            answer = await asyncio.wait_for(pool.answer(Request(PROMPT, SamplingParams(max_tokens=24), "after")), HANG_S)
            return answer, await pool.redis.xlen("specmesh:outputs:x"), await pool.redis.xlen(admissions)

    answer, posted, left = asyncio.run(main())
    assert answer == plain_greedy(tiny_model, PROMPT, 24)
    assert posted == 0 and left == 0  # none served, none left behind


def test_forged_outputs_are_dropped_and_counted_and_the_answer_is_the_verifiers(redis_server, tiny_model):
    """Outputs on a router's stream without a valid tag (written by something that is not a verifier) never
    reach a client: the request's answer is the verifier's, and the router counts each one."""
    request = Request(PROMPT, SamplingParams(max_tokens=200), "target")
    forged = verifier_pb2.StepOutputs(verifier_id="v0", deltas=[verifier_pb2.RequestDelta(
        request_id="target", position=0, tokens=[1, 2, 3], finish_reason="stop")]).SerializeToString()

    async def main():
        async with EnginePool(redis_server.url, tiny_model) as pool:
            dropped = []
            pool.client.on_forged = lambda: dropped.append(1)
            seen = asyncio.Event()
            answering = asyncio.create_task(pool.answer(request, on_delta=lambda delta: seen.set()))
            await asyncio.wait_for(seen.wait(), HANG_S)  # under way: the forged ones would be taken now
            await pool.redis.xadd(pool.client.outputs, {"outputs": forged, "tag": b"\x00" * 32})  # a wrong tag
            await pool.redis.xadd(pool.client.outputs, {"outputs": forged})  # none
            return await asyncio.wait_for(answering, HANG_S), len(dropped)

    answer, dropped = asyncio.run(main())
    assert answer == plain_greedy(tiny_model, PROMPT, 200)
    assert dropped == 2


def test_a_pass_longer_than_the_heartbeat_is_not_taken_for_a_death(redis_server, tiny_model, caplog):
    caplog.set_level(logging.INFO, "specmesh.cluster.pipeline.engine_worker")

    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0) as pool:
            await pool.add_node("slow", verifier=lambda runtime: SlowVerifier(runtime, pass_s=1.5))  # 1 s TTL
            answer = asyncio.create_task(pool.answer(Request(PROMPT, SamplingParams(max_tokens=6), "long")))
            await wait_until_async(lambda: pool.nodes[0].holds("long"), what="the slow verifier took the request")
            other = await pool.add_node("other")  # idle beside it: it must not adopt the live one's request
            return await asyncio.wait_for(answer, HANG_S), await deltas_by_verifier(pool, "long"), other

    answer, posted, other = asyncio.run(main())
    assert answer == plain_greedy(tiny_model, PROMPT, 6)
    assert set(posted) == {"slow"} and jobs(other, "ok") == 0
    assert "took over" not in caplog.text and "stood still" not in caplog.text


def test_a_verifier_restarted_under_its_id_finishes_what_it_held_from_its_log(redis_server, tiny_model, caplog):
    caplog.set_level(logging.INFO, "specmesh.cluster.pipeline.engine_worker")
    request = Request(PROMPT, SamplingParams(max_tokens=300), "held")

    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=1) as pool:
            stopped = []

            def on_delta(delta):
                if not stopped:  # it dies with the request under way, and comes back under the same id
                    stopped.append(asyncio.get_running_loop().run_in_executor(None, pool.nodes[0].stop))

            answering = asyncio.create_task(pool.answer(request, on_delta=on_delta))
            await wait_until_async(lambda: stopped and stopped[0].done(), what="the verifier stopped")
            await pool.add_node("v0")
            return await asyncio.wait_for(answering, HANG_S), await deltas_by_verifier(pool, "held")

    answer, posted = asyncio.run(main())
    assert answer == plain_greedy(tiny_model, PROMPT, 300)
    assert "took over 1 request(s) v0 held" in caplog.text and len(posted) > 1


def test_a_request_whose_client_left_is_let_go_with_its_cache(redis_server, tiny_model):
    async def main():
        async with EnginePool(redis_server.url, tiny_model) as pool:
            node, seen = pool.nodes[0], asyncio.Event()
            leaving = asyncio.create_task(pool.answer(Request(PROMPT, SamplingParams(max_tokens=400), "left"),
                                                      on_delta=lambda delta: seen.set()))
            await asyncio.wait_for(seen.wait(), HANG_S)
            leaving.cancel()
            await asyncio.gather(leaving, return_exceptions=True)
            await wait_until_async(lambda: node.sessions == 0 and not node.holds("left"), what="the request let go")
            gauge = node.worker.metrics.registry.get_sample_value("specmesh_kv_sessions")
            return await pool.redis.xlen(pool.keys.admissions), gauge

    assert asyncio.run(main()) == (0, 0)  # its admission acknowledged and deleted; the gauge says so at once


def test_an_admission_whose_client_left_before_a_verifier_took_it_is_never_run(redis_server, tiny_model):
    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0) as pool:
            leaving = asyncio.create_task(pool.answer(Request(PROMPT, SamplingParams(max_tokens=8), "gone")))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.admissions), what="admitted")
            leaving.cancel()
            await asyncio.gather(leaving, return_exceptions=True)
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.aborts), what="its abort posted")
            node = await pool.add_node("late")
            answer = await asyncio.wait_for(pool.answer(Request(PROMPT, SamplingParams(max_tokens=8), "next")), HANG_S)
            return answer, await pool.redis.xlen(pool.keys.admissions), await deltas_by_verifier(pool, "gone"), node

    answer, left, posted, node = asyncio.run(main())
    assert answer == plain_greedy(tiny_model, PROMPT, 8) and left == 0
    assert posted == [] and jobs(node, "ok") == node.worker.verifier.stats.batches  # "next" alone was verified


LONG_PROMPT = tuple(3 + (i * 7) % 90 for i in range(480))


def test_a_long_prefill_goes_in_chunks_between_the_steps_of_a_decoding_request(redis_server, tiny_model):
    """A 480-token prompt admitted beside a decoding request is cached a chunk per pass: the decoding request
    keeps getting tokens meanwhile (not only after the whole prefill)."""

    async def main():
        async with EnginePool(redis_server.url, tiny_model) as pool:
            order = []
            short = asyncio.create_task(pool.answer(Request(PROMPT, SamplingParams(max_tokens=400), "short"),
                                                    on_delta=lambda delta: order.append("short")))
            await wait_until_async(lambda: "short" in order, what="the short request decodes")
            order.append("admitted")
            long = await asyncio.wait_for(pool.answer(Request(LONG_PROMPT, SamplingParams(max_tokens=8), "long"),
                                                      on_delta=lambda delta: order.append("long")), HANG_S)
            return long, await asyncio.wait_for(short, HANG_S), order

    long, short, order = asyncio.run(main())
    assert long == plain_greedy(tiny_model, LONG_PROMPT, 8) and short == plain_greedy(tiny_model, PROMPT, 400)
    during = order[order.index("admitted"):order.index("long")]
    assert during.count("short") >= 2, order  # its first chunk of 64 tokens, then at most twice as many a pass


def test_a_pass_longer_than_the_routers_timeout_is_waited_for(redis_server, tiny_model):
    """Passes of 1.5 s under a 1 s router timeout: the request, still admitted, is waited for, not failed."""

    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0, timeout_s=1.0) as pool:
            await pool.add_node("slow", verifier=lambda runtime: SlowVerifier(runtime, pass_s=1.5))
            started = time.monotonic()
            answer = await asyncio.wait_for(pool.answer(Request(PROMPT, SamplingParams(max_tokens=4), "slow")), HANG_S)
            return answer, time.monotonic() - started

    answer, took = asyncio.run(main())
    assert answer == plain_greedy(tiny_model, PROMPT, 4) and took > 1.5


def test_requests_after_redis_was_killed_and_restarted_empty_are_served(restartable_redis, tiny_model):
    server = restartable_redis

    async def main():
        async with EnginePool(server.url, tiny_model, workers=2) as pool:
            request = Request(PROMPT, SamplingParams(max_tokens=16))
            before = await asyncio.wait_for(pool.answer(request), HANG_S)
            server.process.kill()
            server.process.wait()
            server.start()
            after = await asyncio.wait_for(asyncio.gather(*(pool.answer(Request(PROMPT, SamplingParams(max_tokens=16),
                                                                                f"after-{i}")) for i in range(8))),
                                           HANG_S)
            return before, after

    before, after = asyncio.run(main())
    expected = plain_greedy(tiny_model, PROMPT, 16)
    assert before == expected and after == [expected] * 8


def test_an_answer_sent_whole_is_posted_once_also_after_its_verifier_restarted(redis_server, tiny_model, caplog):
    """A router that sends the answer whole (``final_only``): the verifier logs its tokens by time but posts
    only the end, one delta with the whole answer, also when it died mid-way and took the request back from
    its log."""
    caplog.set_level(logging.INFO, "specmesh.cluster.pipeline.engine_worker")
    request = Request(PROMPT, SamplingParams(max_tokens=300), "whole")

    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0) as pool:
            # passes 20 ms longer: the answer takes seconds, its tokens logged several times meanwhile
            await pool.add_node("v0", verifier=lambda runtime: SlowVerifier(runtime, pass_s=0.02))

            async def deltas():
                return [d async for d in pool.client.generate(request, 6, fixed_budget=True, final_only=True)]

            answering = asyncio.create_task(deltas())
            while await pool.redis.xlen(pool.keys.commit_log("v0")) < 2:  # logged twice, nothing posted
                await asyncio.sleep(0.005)
            assert await deltas_by_verifier(pool, "whole") == []
            await asyncio.to_thread(pool.nodes[0].stop)
            await pool.add_node("v0")
            return await asyncio.wait_for(answering, HANG_S), await deltas_by_verifier(pool, "whole")

    answer, posted = asyncio.run(main())
    assert len(answer) == 1 and answer[0].finish_reason == "length" and answer[0].stats is not None
    assert answer[0].tokens == plain_greedy(tiny_model, PROMPT, 300)
    assert posted == ["v0"], "one message, at the end"
    assert "took over 1 request(s) v0 held" in caplog.text


class _ThreadNoting(TreeVerifier):
    """The real verifier, noting which thread ran each pass."""

    def __init__(self, runtime) -> None:
        super().__init__(runtime)
        self.threads: set[str] = set()

    def verify(self, jobs, prefill_ms=None, alone_ms=None):
        self.threads.add(threading.current_thread().name)
        return super().verify(jobs, prefill_ms, alone_ms)


def test_a_cpu_verifier_passes_on_its_event_loop_and_answers_as_plain(redis_server, tiny_model):
    """Torch work inline (a CPU verifier's): every pass on the node's event loop thread, and streamed and
    whole answers, speculative or plain, equal plain decoding."""
    expected = plain_greedy(tiny_model, PROMPT, 120)

    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0) as pool:
            node = await pool.add_node("v0", inline=True, verifier=_ThreadNoting)

            async def answer(i: int, budget: int, final_only: bool) -> list[int]:
                request = Request(PROMPT, SamplingParams(max_tokens=120), f"inline-{i}")
                return [t for d in [d async for d in pool.client.generate(request, budget, fixed_budget=budget > 0,
                                                                          final_only=final_only)] for t in d.tokens]

            answers = await asyncio.wait_for(asyncio.gather(
                *(answer(i, budget, final_only) for i, (budget, final_only) in enumerate(
                    [(6, False), (6, True), (0, False), (0, True)] * 2))), HANG_S)
            return answers, node.worker.verifier.threads, node.thread.name

    answers, threads, node_thread = asyncio.run(main())
    assert answers == [expected] * 8
    assert threads == {node_thread}


def test_a_burst_of_admissions_spreads_over_the_verifiers_free_to_take_it(redis_server, tiny_model):
    requests = [Request(PROMPT, SamplingParams(max_tokens=12), f"burst-{i}") for i in range(24)]
    expected = plain_greedy(tiny_model, PROMPT, 12)

    async def main():
        async with EnginePool(redis_server.url, tiny_model, workers=0) as pool:
            # CPU verifiers (passes on their loops): one that read all it could took ~20 of the 24
            nodes = [await pool.add_node(name, inline=True) for name in ("a", "b")]
            await wait_until_async(lambda: all(n.worker._joined.is_set() and n.worker._others_alive for n in nodes),
                                   what="both read admissions and see the other alive")
            await asyncio.sleep(0.2)  # both listeners wait in Redis
            answers = await asyncio.wait_for(asyncio.gather(*(pool.answer(r, budget=0) for r in requests)), HANG_S)
            return answers, [(await deltas_by_verifier(pool, r.request_id))[0] for r in requests]

    answers, takers = asyncio.run(main())
    assert answers == [expected] * len(requests)
    assert set(takers) <= {"a", "b"}
    # beside another verifier, a read takes TAKE_AT_ONCE at most, and the next waits for the step taking them in
    assert min(takers.count("a"), takers.count("b")) >= len(requests) // 4, takers
