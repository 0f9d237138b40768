"""The pipeline queue on a real redis-server: the speculation loop through Redis Streams and verifier
workers (in-process, tiny model) gives the engine's outputs; jobs of a dead verifier are reclaimed;
re-sent jobs are answered once; Redis going away fails requests with UNAVAILABLE, not hangs."""

import asyncio
import time
from contextlib import aclosing

import pytest
from cluster_parts import InProcessPool
from conftest import HANG_S, wait_until_async

from specmesh.cluster.pipeline.verifier_end import VerifierQueue
from specmesh.cluster.pipeline.messages import decode_job, encode_job
from specmesh.cluster.pipeline.scheduling import PassRhythm, plan_batch
from specmesh.cluster.pipeline.messages import JOB
from specmesh.drafters.ngram import HistoryDrafter, NgramDrafter
from specmesh.errors import Unavailable
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.tree_verifier import VerifyJob
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.speculation.drafting import LocalDrafter
from specmesh.speculation.loop import speculate
from specmesh.speculation.requests import SpeculationStats
from specmesh.tree import TokenTree
from specmesh.v1 import verifier_pb2

MAX_TOKENS = 24
PROMPTS = [(5, 6, 7, 5, 6), (9, 10, 11, 12), (3, 4, 3, 4, 3, 4, 3), (20, 21), (7,), (30, 31, 32, 33, 30, 31)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = SpeculativeEngine(LlamaRuntime(tiny_model), [], max_tree_nodes=0)
    return engine.generate([Request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS])


async def run_request(request, drafters, client, budget=6, stats=None, draft_ahead=False):
    tokens = []
    async with aclosing(speculate(request, drafters, client, budget, stats=stats, draft_ahead=draft_ahead)) as steps:
        async for step in steps:
            tokens += step.token_ids
    return tokens


def test_speculation_through_redis_gives_the_engines_outputs(redis_server, tiny_model, reference):
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=2) as pool:
            drafters = [LocalDrafter(NgramDrafter())]
            requests = [Request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS]
            outputs = await asyncio.gather(*(run_request(r, drafters, pool.client) for r in requests))
            # every request's KV cache is freed when it ends (once the close messages are served)
            await wait_until_async(lambda: all(w.verifier.num_sessions == 0 for w in pool.workers),
                                   what="the verifiers freed every session")
            leftover = await pool.redis.xlen(pool.keys.jobs)
        return outputs, leftover

    outputs, leftover = asyncio.run(main())
    assert outputs == [r.token_ids for r in reference]
    assert leftover == 0  # answered jobs are deleted from the stream


def test_drafting_ahead_reuses_confirmed_trees_and_changes_no_output(redis_server, tiny_model, reference):
    history = HistoryDrafter(min_n=1, max_n=3)
    for i, (prompt, done) in enumerate(zip(PROMPTS, reference)):  # earlier answers: whole paths get accepted
        history.start(f"earlier{i}", prompt + tuple(done.token_ids))
        history.end(f"earlier{i}")

    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            drafters = [LocalDrafter(history), LocalDrafter(NgramDrafter())]
            stats = [SpeculationStats() for _ in PROMPTS]
            outputs = await asyncio.gather(*(
                run_request(Request(p, SamplingParams(max_tokens=MAX_TOKENS)), drafters, pool.client, budget=4,
                            stats=s, draft_ahead=True)
                for p, s in zip(PROMPTS, stats)
            ))
        return outputs, stats

    outputs, stats = asyncio.run(main())
    assert outputs == [r.token_ids for r in reference]
    assert sum(s.drafted_ahead for s in stats) > len(PROMPTS)  # confirmed drafts were used, several a request
    assert sum(s.target_steps for s in stats) < len(PROMPTS) * MAX_TOKENS / 3


async def members_are(pool: InProcessPool, expected: set[bytes]) -> bool:
    return await pool.redis.smembers(pool.keys.members) == expected


def test_jobs_held_by_a_dead_verifier_are_reclaimed(redis_server, tiny_model, reference):
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0, resend_after_s=60) as pool:
            ghost = VerifierQueue(pool.redis, pool.keys, "ghost", heartbeat_ttl_s=0.2)
            await ghost.register()
            prompt = PROMPTS[0]
            job = VerifyJob("req", 0, len(prompt) - 1, prompt[-1], TokenTree(), SamplingParams(max_tokens=MAX_TOKENS),
                            history=prompt[:-1])
            waiting = asyncio.create_task(pool.client.verify(job))
            await wait_until_async(lambda: pool.redis.xlen(pool.keys.jobs), what="the job is in the pool's stream")
            taken = await ghost.read(count=10, block_ms=100, include_pool=True)  # ghost takes it, then dies
            assert len(taken) == 1
            # a second job was already queued on the ghost's own stream (affinity) when it died
            own = VerifyJob("req2", 0, len(prompt) - 1, prompt[-1], TokenTree(), SamplingParams(max_tokens=MAX_TOKENS),
                            history=prompt[:-1])
            payload = encode_job(own, pool.client.reply_to, 0)
            await pool.redis.xadd(pool.keys.own_jobs("ghost"), {"job": payload, "tag": pool.signer.tag(JOB, payload)})
            pool.client._waiting[("req2", 0)] = asyncio.get_running_loop().create_future()
            pool.add_worker("survivor")
            # answered by reclaiming: the client would resend only after 60 s, later than these bounds
            first = await asyncio.wait_for(waiting, 45)
            second = await asyncio.wait_for(pool.client._waiting[("req2", 0)], 45)
            # the emptied stream of the dead verifier goes at the next reclaim round
            await wait_until_async(lambda: members_are(pool, {b"survivor"}), timeout_s=45,
                                   what="the dead verifier's stream was adopted, then removed")
            return first, second

    first, second = asyncio.run(main())
    assert first.verdict.tokens[-1] == reference[0].token_ids[0]
    assert second.verifier_id == "survivor" and list(second.tokens)[-1] == reference[0].token_ids[0]


async def blocked_readers(redis) -> int:
    return sum("b" in client["flags"] and client["cmd"] == "xreadgroup" for client in await redis.client_list())


def test_a_read_whose_stream_is_adopted_away_returns_empty_instead_of_crashing(redis_server):
    """A draining verifier has stopped its heartbeat; another adopts and deletes its own stream while its
    read is blocked on it (Redis answers UNBLOCKED). Draining, it reads nothing more and stays unregistered;
    serving, it re-registers and reads on."""
    import redis.asyncio as aioredis

    from specmesh.cluster.pipeline.messages import QueueKeys

    async def main():
        redis = aioredis.Redis.from_url(redis_server.url)
        keys = QueueKeys(pool="adopted")
        outcomes = []
        try:
            for include_pool in (False, True):
                queue = VerifierQueue(redis, keys, f"leaving-{include_pool}")
                await queue.register()
                await queue.unregister()
                # blocked far longer than the test may wait: only Redis's UNBLOCKED can end this read in time
                blocked = asyncio.create_task(queue.read(count=10, block_ms=600_000, include_pool=include_pool))
                await wait_until_async(lambda: blocked_readers(redis), what="the read is blocked in Redis")
                await redis.delete(keys.own_jobs(queue.verifier_id))  # as the adopting verifier does
                entries = await asyncio.wait_for(blocked, HANG_S)
                alive = bool(await redis.exists(keys.alive(queue.verifier_id)))
                again = await queue.read(count=10, block_ms=10, include_pool=include_pool)
                outcomes.append((entries, alive, again))
        finally:
            await redis.aclose()
        return outcomes

    (draining, serving) = asyncio.run(main())
    assert draining == ([], False, [])  # no crash, and a draining verifier is not made alive again
    assert serving == ([], True, [])  # a serving one re-registers and its next read works


def test_a_resent_job_is_answered_from_the_first_result(redis_server, tiny_model):
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            prompt = PROMPTS[1]
            job = VerifyJob("dup", 0, len(prompt) - 1, prompt[-1], TokenTree(), SamplingParams(max_tokens=8),
                            history=prompt[:-1])
            first = await pool.client.verify(job)
            again = await pool.client.verify(job)  # as after a lost result: same step, once more
            return first, again, pool.workers[0].verifier.stats.batches

    first, again, batches = asyncio.run(main())
    assert first.verdict == again.verdict
    assert batches == 1  # the second answer came from the posted result, not a second pass


def test_redis_down_fails_with_unavailable_then_recovers(tiny_model, restartable_redis):
    server = restartable_redis

    async def main():
        async with InProcessPool(server.url, tiny_model, workers=1, job_timeout_s=2.0, resend_after_s=0.5) as pool:
            request = Request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS))
            before = await run_request(request, [], pool.client)
            server.stop()
            with pytest.raises(Unavailable):  # after job_timeout_s; a hang fails at HANG_S instead
                await asyncio.wait_for(
                    run_request(Request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS)), [], pool.client), HANG_S)
            server.start()
            await wait_until_async(lambda: pool.redis.sismember(pool.keys.members, "v0"),
                                   what="the worker re-registered in the emptied Redis")
            after = await run_request(Request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS)), [], pool.client)
            return before, after

    before, after = asyncio.run(main())
    assert before == after


def test_the_next_pass_waits_briefly_only_for_the_last_pass_requests_still_on_their_way():
    rhythm = PassRhythm(max_wait_share=0.25, max_wait_ms=50.0, average=0.5)
    assert rhythm.wait_ms() == 0.0 and rhythm.missing(["a"]) == set()  # no pass yet: nothing to wait for
    rhythm.passed(["a", "b", "c"], pass_ms=100.0)
    assert rhythm.missing(["a", "x"]) == {"b", "c"}  # x is new: welcome, but not waited for
    assert rhythm.wait_ms() == 25.0  # a quarter of a pass
    rhythm.ended("b")  # its close arrived: it sends nothing more
    assert rhythm.missing(["a"]) == {"c"}
    rhythm.passed(["a", "c"], pass_ms=1000.0)
    assert rhythm.pass_ms == 550.0 and rhythm.wait_ms() == 50.0  # a moving average, capped
    assert rhythm.missing(["a", "c"]) == set()
    assert rhythm.busy(within_s=60)  # a and c are going: a pass of prefills alone is not alone
    rhythm.ended("a")
    rhythm.ended("c")
    assert not rhythm.busy(within_s=60)
    rhythm.passed(["d"], pass_ms=10.0)
    time.sleep(0.02)
    assert rhythm.busy(within_s=60) and not rhythm.busy(within_s=0.01)  # d is quiet: gone, as far as it knows


def test_the_batch_scheduler_fills_a_row_budget_in_readiness_order():
    jobs = [("a", 10), ("b", 50), ("a", 5), ("c", 30), ("d", 200), ("e", 10)]
    batch, rest = plan_batch(jobs, rows_of=lambda j: j[1], request_of=lambda j: j[0], max_rows=100)
    assert batch == [("a", 10), ("b", 50), ("c", 30), ("e", 10)]  # one job per request; d does not fit
    assert rest == [("a", 5), ("d", 200)]
    big, rest = plan_batch([("d", 200), ("a", 1)], lambda j: j[1], lambda j: j[0], max_rows=100)
    assert big == [("d", 200)] and rest == [("a", 1)]  # an oversized job still goes, alone
    assert plan_batch([], lambda j: 1, lambda j: j, 10) == ([], [])



# ---- entries that no router or verifier wrote (someone else with access to Redis) ----


def test_a_forged_result_is_dropped_counted_and_the_output_unchanged(redis_server, tiny_model, reference):
    """An attacker who answers a victim's job before any verifier does gets nothing to the client."""
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=0) as pool:
            request = Request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS), "victim")
            victim = asyncio.create_task(run_request(request, [LocalDrafter(NgramDrafter())], pool.client))
            while not await pool.redis.xlen(pool.keys.jobs):  # the victim's first job, not yet taken
                await asyncio.sleep(0.01)
            (_, fields), = await pool.redis.xrange(pool.keys.jobs)
            queued = decode_job(fields[b"job"])
            forged = verifier_pb2.VerifyResult(request_id=queued.job.request_id, step=queued.job.step,
                                               verifier_id="v0", tokens=[1, 2, 3]).SerializeToString()
            await pool.redis.xadd(queued.reply_to, {"result": forged})  # untagged
            await pool.redis.xadd(queued.reply_to, {"result": forged, "tag": b"\x00" * 32})  # a wrong tag
            await wait_until_async(lambda: pool.client.forged_results == 2, what="both forgeries dropped")
            assert not victim.done()  # still waiting for a real verifier
            pool.add_worker("v0")
            return await victim, pool.client.forged_results

    output, forged = asyncio.run(main())
    assert output == reference[0].token_ids and forged == 2


def test_a_forged_job_is_never_run_and_cannot_poison_another_request(redis_server, tiny_model, reference):
    """A job posted for a victim's request id (another prompt, so that a cached answer would derail the
    victim) is dropped unrun by the verifier and counted."""
    async def main():
        async with InProcessPool(redis_server.url, tiny_model, workers=1) as pool:
            job = VerifyJob("victim", 0, 2, 99, TokenTree(), SamplingParams(max_tokens=MAX_TOKENS), history=(98, 97))
            for tag in ({}, {"tag": b"\x01" * 32}):
                await pool.redis.xadd(pool.keys.jobs, {"job": encode_job(job, "specmesh:results:attacker", 0), **tag})
            worker = pool.workers[0]

            def forged() -> float:
                return worker.metrics.registry.get_sample_value("specmesh_verify_jobs_total", {"outcome": "forged"}) or 0

            await wait_until_async(lambda: forged() == 2, what="the verifier dropped both forged jobs")
            request = Request(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS), "victim")
            output = await run_request(request, [LocalDrafter(NgramDrafter())], pool.client)
            answered = await pool.redis.exists("specmesh:results:attacker")
        return output, answered

    output, answered = asyncio.run(main())
    assert output == reference[2].token_ids
    assert not answered  # nothing was computed for the forger either
