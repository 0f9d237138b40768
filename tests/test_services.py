"""The gRPC services over loopback with the client SDK: a tiny model with the embedded model's
tokenizer, a real redis-server, the router and a drafter as real gRPC servers. Outputs equal plain
decoding; bad input gets INVALID_ARGUMENT naming the field; overload RESOURCE_EXHAUSTED; a cancelled
stream frees every session; a drafter that dies costs no request; health and reflection answer."""

import asyncio
import dataclasses
import json
import sys
import time

import grpc
import pytest
import torch
from cluster_parts import ServiceStack, SlowVerifier, passes_held, plain_greedy
from conftest import wait_until_async
from drafting import OracleTreeDrafter
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specmesh.client import AsyncClient, generate_request
from specmesh.cluster.gateway import GatewayLimits
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.serving import Service, TorchThread, start_server
from specmesh.drafters.ngram import HistoryDrafter, NgramDrafter
from specmesh.sampling import SamplingParams
from specmesh.cluster.drafter_sessions import DrafterSessions
from specmesh.services.drafter.server import DrafterServicer
from specmesh.tree import MAX_TREE_NODES
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, router_pb2, router_pb2_grpc

MAX_TOKENS = 20
CHAT = [("user", "Repeat after me: one two three one two three one two three")]


def run(coroutine):
    return asyncio.run(coroutine)


def test_generate_and_stream_equal_plain_decoding(redis_server, model, tokenizer):
    async def main():
        # a history drafter: the second request of the same prompt is drafted from the first's answer
        async with ServiceStack(redis_server.url, model, tokenizer, HistoryDrafter(min_n=1, max_n=3)) as stack:
            async with AsyncClient(stack.address) as client:
                whole = await client.generate(chat=CHAT, max_tokens=MAX_TOKENS)
                chunks = [c async for c in client.stream(chat=CHAT, max_tokens=MAX_TOKENS)]
                by_ids = await client.generate(prompt_ids=[5, 6, 7, 5, 6, 7], max_tokens=MAX_TOKENS)
                count = await client.count_tokens(chat=CHAT)
                models = await client.list_models()
                info = await client.info()
            blocking = await _blocking_generate(stack.address)
            return whole, chunks, by_ids, count, models, info, blocking, stack.router.encode_chat(CHAT)

    whole, chunks, by_ids, count, models, info, blocking, prompt = run(main())
    assert whole.token_ids == plain_greedy(model, prompt, MAX_TOKENS)
    assert whole.text == tokenizer.decode(whole.token_ids, skip_special_tokens=True)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.prompt_tokens == count == len(prompt)
    assert last.stats.target_steps < MAX_TOKENS / 2  # the repeated request was drafted from history
    assert by_ids.token_ids == plain_greedy(model, [5, 6, 7, 5, 6, 7], MAX_TOKENS)
    assert blocking == whole.token_ids
    assert [m.id for m in models] == ["tiny"] and info.drafters[0].healthy and info.verifiers == 1


def test_speculation_modes_and_routing_through_the_router(redis_server, model, tokenizer):
    code_chat = [("user", "Write a Python function that reverses a list, with a docstring.")]

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with AsyncClient(stack.address) as client:
                answers = {mode: await client.generate(chat=code_chat, max_tokens=MAX_TOKENS, speculation=mode)
                           for mode in ("adaptive", "fixed", "off")}
                for nodes in (2, 40):  # the router's cap is 6: a request may lower it, not raise it
                    answers[f"fixed-{nodes}"] = await client.generate(chat=code_chat, max_tokens=MAX_TOKENS,
                                                                      speculation="fixed", max_tree_nodes=nodes)
                info = await client.info()
            return answers, info, stack.router.encode_chat(code_chat)

    answers, info, prompt = run(main())
    for mode, answer in answers.items():
        assert answer.token_ids == plain_greedy(model, prompt, MAX_TOKENS), mode
        assert answer.stats.request_kind == "code", mode
        assert 0 < answer.stats.verifier_ms < answer.stats.verify_ms, mode  # the rest was queue and transport
    assert answers["off"].stats.drafted_nodes == 0 and answers["off"].stats.drafter_steps == {}
    fixed = answers["fixed"].stats
    assert list(fixed.drafter_steps) == ["ngram"] and fixed.target_steps - 1 <= fixed.drafter_steps["ngram"] <= fixed.target_steps
    for nodes, cap in ((2, 2), (40, 6)):
        stats = answers[f"fixed-{nodes}"].stats
        assert 0 < stats.drafted_nodes <= cap * stats.target_steps, (nodes, stats)
    assert answers["fixed-40"].stats.drafted_nodes == fixed.drafted_nodes  # the same trees as at the cap
    assert info.speculation == "fixed"
    assert [(e.kind, e.drafter) for e in info.routing] == [("code", "ngram")]  # learned from the requests
    with pytest.raises(ValueError, match="speculation"):  # the SDK refuses an unknown mode before sending
        generate_request("hi", speculation="sometimes")


async def _blocking_generate(address):
    """The blocking client, in a process of its own: grpc's sync and asyncio stacks in one process can
    deadlock each other (grpc/grpc#22733), and this process serves the router with asyncio."""
    script = (
        "import json, sys\nfrom specmesh.client import Client\n"
        f"with Client({address!r}) as client:\n"
        f"    print(json.dumps(client.generate(chat={CHAT!r}, max_tokens={MAX_TOKENS}).token_ids))\n"
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0
    return json.loads(out)


BAD_REQUESTS = [
    (dict(prompt=""), "prompt"),
    (dict(prompt_ids=[]), "prompt"),
    (dict(prompt_ids=[10**7]), "prompt"),
    (dict(chat=[("robot", "hi")]), "role"),
    (dict(chat=[]), "chat"),
    (dict(prompt="a\x00b"), "prompt"),  # NUL: no text (a lone surrogate cannot reach gRPC: protobuf strings are UTF-8)
    (dict(chat=[("user", "a\x00b")]), "chat.messages[0].content"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-3), "top_k"),
    (dict(prompt="hi", max_tokens=-5), "max_tokens"),
    (dict(prompt="hi", max_tokens=10**6), "max_tokens"),
    (dict(prompt="hi", max_tree_nodes=MAX_TREE_NODES + 1), "max_tree_nodes"),
    (dict(prompt="hi", request_id="x" * 500), "request_id"),
]


def test_a_resumed_stream_goes_on_from_the_tokens_the_client_has(redis_server, model, tokenizer):
    """A stream cut short is asked for again with the tokens received (``resume_ids``): the chunks carry
    what follows them, the usage counts the whole answer; an answer already complete is a clear 400."""
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with AsyncClient(stack.address) as client, grpc.aio.insecure_channel(stack.address) as channel:
                whole = await client.generate(chat=CHAT, max_tokens=MAX_TOKENS)
                stub = router_pb2_grpc.RouterStub(channel)

                def resumed(ids):
                    message = generate_request(chat=CHAT, max_tokens=MAX_TOKENS)
                    message.resume_ids.ids.extend(ids)
                    return message

                chunks = [c async for c in stub.GenerateStream(resumed(whole.token_ids[:7]), timeout=60)]
                errors = []
                # the tiny model has no end-of-sequence token: one that its answer never holds becomes it
                eos = next(t for t in range(3, 100) if t not in whole.token_ids)
                stack.router.card = dataclasses.replace(stack.router.card, eos_token_ids=frozenset({eos}))
                for ids in (whole.token_ids, [*whole.token_ids[:3], eos], [5, -1]):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Generate(resumed(ids), timeout=10)
                    errors.append((err.value.code(), err.value.details()))
            return whole, chunks, errors, stack.router.encode_chat(CHAT)

    whole, chunks, errors, prompt = run(main())
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids[7:]
    head = tokenizer.decode(whole.token_ids[:7], skip_special_tokens=True)
    assert head + "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS and chunks[-1].usage.prompt_tokens == len(prompt)
    for code, details in errors[:2]:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "resume_ids" in details and "complete" in details
    assert errors[2][0] == grpc.StatusCode.INVALID_ARGUMENT and "resume_ids" in errors[2][1] and "-1" in errors[2][1]


def test_invalid_arguments_are_refused_naming_the_field(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            errors = []
            async with AsyncClient(stack.address) as client:
                for kwargs, _ in BAD_REQUESTS:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate(**kwargs)
                    errors.append((err.value.code(), err.value.details()))
                async with grpc.aio.insecure_channel(stack.address) as channel:  # raw messages the SDK would refuse
                    for message in [router_pb2.GenerateRequest(),  # no input at all
                                    router_pb2.GenerateRequest(prompt="hi", speculation=99)]:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await router_pb2_grpc.RouterStub(channel).Generate(message, timeout=10)
                        errors.append((err.value.code(), err.value.details()))
                ok = await client.generate(prompt="still fine", max_tokens=3)  # nothing crashed
            return errors, ok

    errors, ok = run(main())
    assert len(errors) == len(BAD_REQUESTS) + 2
    for (kwargs, field), (code, details) in zip(BAD_REQUESTS + [({}, "input"), ({}, "speculation")], errors):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (kwargs, code, details)
        assert field in details, (kwargs, details)
    assert len(ok.token_ids) == 3


def test_drafter_service_errors(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.drafter_server.port}") as channel:
                stub = drafter_pb2_grpc.DrafterStub(channel)
                codes = []
                for call, message in [
                    (stub.Propose, drafter_pb2.ProposeRequest(request_id="nobody", budget=4)),
                    (stub.OpenSession, drafter_pb2.OpenSessionRequest(request_id="r", prompt_ids=[])),
                    (stub.OpenSession, drafter_pb2.OpenSessionRequest(request_id="r", prompt_ids=[1, 10**8])),
                    (stub.Propose, drafter_pb2.ProposeRequest(request_id="r", budget=MAX_TREE_NODES + 1)),
                ]:
                    try:
                        await call(message, timeout=10)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
                await stub.OpenSession(drafter_pb2.OpenSessionRequest(request_id="r", prompt_ids=[4, 5, 6, 4, 5]), timeout=10)
                tree = (await stub.Propose(drafter_pb2.ProposeRequest(request_id="r", budget=4), timeout=10)).tree
                await stub.CloseSession(drafter_pb2.CloseSessionRequest(request_id="r"), timeout=10)
                return codes, list(tree.tokens), len(stack.sessions)

    codes, tokens, open_sessions = run(main())
    assert codes == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT,
                     grpc.StatusCode.INVALID_ARGUMENT]
    assert tokens[:1] == [6]  # ... 4 5 -> 6 by lookup
    assert open_sessions == 0


def test_a_drafter_opens_a_session_only_when_asked_to_draft_but_history_sees_every_answer(tokenizer):
    """A request the policy never drafts for (budget 0 all along, routed elsewhere) costs a drafter
    no call at all; a history drafter still hears every answer, since it drafts from earlier ones."""
    async def main():
        counts = {}
        for drafter in (NgramDrafter(), HistoryDrafter(min_n=1, max_n=3)):
            sessions = DrafterSessions(drafter, vocab_size=len(tokenizer), max_sessions=4)
            info = drafter_pb2.DrafterInfo(name=drafter.name, kind=drafter.kind, domains=["general"], tokenizer_hash="h")
            servicer = DrafterServicer(sessions, info, TorchThread("draft"))
            server = await start_server(
                [Service("specmesh.v1.Drafter", lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s))],
                "127.0.0.1:0")
            remote = RemoteDrafter(f"127.0.0.1:{server.port}")
            try:
                await remote.connect("h")
                await remote.start("idle", [5, 6, 7, 5, 6])
                await remote.commit("idle", [7, 5])
                after_start = len(sessions)
                await remote.end("idle")  # its close goes in the background: the request's end holds no step
                await wait_until_async(lambda: not len(sessions), timeout_s=10, what="idle closed")
                await remote.start("asked", [5, 6, 7, 5, 6])
                tree = await remote.propose("asked", 4)
                during = len(sessions)
                await remote.end("asked")
                await wait_until_async(lambda: not len(sessions), timeout_s=10, what="asked closed")
                counts[drafter.kind] = (after_start, list(tree.tokens), during, len(sessions))
            finally:
                await remote.close()
                await server.server.stop(0)
        return counts

    counts = run(main())
    after_start, tokens, during, after = counts["ngram"]
    assert (after_start, during, after) == (0, 1, 0) and tokens[:3] == [7, 5, 6]  # opened by the proposal
    history_after_start, _, history_during, history_after = counts["history"]
    assert (history_after_start, history_during, history_after) == (1, 1, 0)


class SlowDrafter(NgramDrafter):
    """Prompt lookup that takes longer than the router waits for a proposal (a drafter busy under a burst)."""

    def propose(self, request_id, budget, assumed=()):
        time.sleep(0.6)
        return super().propose(request_id, budget, assumed)


def test_a_session_whose_proposal_timed_out_is_closed_when_its_request_ends(tokenizer):
    """A proposal past its deadline marks the drafter down, but its session stays open there: the
    request's end still closes it (it was forgotten, and held until the drafter's idle sweep: a burst of
    64 cancelled streams kept one for 60 s)."""
    async def main():
        drafter = SlowDrafter()
        sessions = DrafterSessions(drafter, vocab_size=len(tokenizer), max_sessions=4)
        info = drafter_pb2.DrafterInfo(name=drafter.name, kind=drafter.kind, domains=["general"], tokenizer_hash="h")
        server = await start_server(
            [Service("specmesh.v1.Drafter", lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(
                DrafterServicer(sessions, info, TorchThread("draft")), s))], "127.0.0.1:0")
        remote = RemoteDrafter(f"127.0.0.1:{server.port}", timeout_s=0.3)
        try:
            await remote.connect("h")
            await remote.start("busy", [5, 6, 7, 5, 6])
            tree = await remote.propose("busy", 4)  # opens the session, then gives up on the proposal
            down = not remote.healthy
            await remote.end("busy")
            await wait_until_async(lambda: len(sessions) == 0, timeout_s=10, what="the session was closed")
        finally:
            await remote.close()
            await server.server.stop(0)
        return len(tree), down

    assert run(main()) == (0, True)


def test_overload_is_resource_exhausted_and_cancel_frees_everything(redis_server, model, tokenizer):
    async def main():
        limits = GatewayLimits(max_concurrent=1, max_tree_nodes=6)
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), limits) as stack:
            async with AsyncClient(stack.address) as client:
                first = client.stream(chat=CHAT, max_tokens=200)
                await first.__anext__()  # under way, holding the only slot
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate(chat=CHAT, max_tokens=5)

                def held():
                    return stack.router.active, len(stack.sessions), stack.pool.workers[0].verifier.num_sessions

                held_at_cancel = held()
                await first.aclose()  # the client walks away mid-stream
                await wait_until_async(lambda: held() == (0, 0, 0), what="the cancelled request freed everything")
                again = await client.generate(chat=CHAT, max_tokens=5)
            return err.value.code(), err.value.details(), held_at_cancel, again

    code, details, held_at_cancel, again = run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in details
    # the stream held the router's only slot and a KV cache on the verifier until the client walked away
    assert held_at_cancel[0] == 1 and held_at_cancel[2] == 1, held_at_cancel
    assert len(again.token_ids) == 5


def test_a_burst_never_puts_more_than_the_limit_in_flight(redis_server, model, tokenizer):
    """200 calls at once while no pass runs (so none finishes): admission counts each request before its
    first await, so exactly the limit is admitted and every other call is RESOURCE_EXHAUSTED."""
    limit, calls = 8, 200

    async def main():
        limits = GatewayLimits(max_concurrent=limit, max_tree_nodes=6)
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), limits) as stack:
            verifier = stack.pool.workers[0]
            async with passes_held(verifier):
                async with grpc.aio.insecure_channel(stack.address) as channel:
                    stub = router_pb2_grpc.RouterStub(channel)
                    message = generate_request(chat=CHAT, max_tokens=50)
                    asking = [stub.Generate(message) for _ in range(calls)]
                    answers = [asyncio.ensure_future(call) for call in asking]
                    await wait_until_async(lambda: sum(a.done() for a in answers) + stack.router.active == calls,
                                           timeout_s=30.0, what="every call refused or admitted")
                    refused = [(a.exception().code(), a.exception().details()) for a in answers if a.done()]
                    admitted = stack.router.active
                    for call in asking:
                        call.cancel()
            await wait_until_async(lambda: stack.router.active == 0, what="the admitted calls freed")
            return admitted, refused

    admitted, refused = run(main())
    assert admitted == limit and len(refused) == calls - limit, (admitted, len(refused))
    assert {code for code, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    counts = {int(details.split()[0]) for _, details in refused}
    assert counts == {limit}, f"refusals saw these in flight (limit {limit}): {sorted(counts)}"


def test_one_request_s_numbers_fail_that_request_alone(redis_server, model, tokenizer, monkeypatch):
    """16 streams share passes with a request at temperature 1e-40 (its logits / T overflowed to NaN and
    failed the whole pass) and one whose logits are forced to NaN: the 16 equal plain decoding, the first odd
    one is greedy decoding, the second ends INTERNAL naming the cause, and nothing is retried as UNAVAILABLE."""
    streams = 16

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), metrics=True) as stack:
            verifier = stack.pool.workers[0].verifier
            forward = verifier.runtime.forward

            def poisoned_forward(batch, logits_rows=None):  # the rows of the request named "poison" come out NaN
                logits = forward(batch, logits_rows=logits_rows)
                # [logits rows]: the pass row each logits row is for (a pass with a prefill chunk keeps only
                # the verified trees' rows)
                rows = torch.arange(len(logits)) if logits_rows is None else logits_rows.cpu()
                poisoned = {id(s) for rid, s in verifier._sessions.items() if rid.startswith("poison:")}
                for i, session in enumerate(batch.sessions):
                    if id(session) in poisoned:
                        logits[((rows >= batch.cu_rows[i]) & (rows < batch.cu_rows[i + 1])).to(logits.device)] = float("nan")
                return logits

            monkeypatch.setattr(verifier.runtime, "forward", poisoned_forward)
            async with AsyncClient(stack.address) as client:
                async def streamed(**kwargs):
                    return [t async for c in client.stream(chat=CHAT, max_tokens=MAX_TOKENS, **kwargs) for t in c.token_ids]

                async def poisoned():
                    try:
                        await streamed(request_id="poison", temperature=0.7, seed=3)
                    except grpc.aio.AioRpcError as exc:
                        return exc.code(), exc.details()

                answers = await asyncio.gather(*(streamed() for _ in range(streams)), streamed(temperature=1e-40),
                                               poisoned())
            return answers, stack.router.encode_chat(CHAT), verifier.num_sessions, stack.pool.workers[0].metrics

    answers, prompt, sessions_left, worker_metrics = run(main())
    plain = plain_greedy(model, prompt, MAX_TOKENS)
    assert all(tokens == plain for tokens in answers[:streams])
    assert answers[streams] == plain  # 1e-40 is greedy decoding
    code, details = answers[streams + 1]
    assert code == grpc.StatusCode.INTERNAL and "probabilities are not finite" in details, (code, details)
    assert worker_metrics.jobs.labels("failed")._value.get() == 1
    assert worker_metrics.jobs.labels("error")._value.get() == 0
    assert sessions_left == 0


def test_a_cancellation_the_queue_s_redis_call_swallowed_still_stops_admission(redis_server, model, tokenizer,
                                                                                monkeypatch):
    """redis-py's send (asyncio.wait_for on Python 3.11) returns the answer when the task's cancellation
    lands in the same loop round: the cancellation is consumed, no later await raises, and a client that
    left went on decoding (4 runs in 10 of the HTTP burst test, which cannot choose the round). Here the
    admission's real XLEN is followed by exactly that: the request must not be admitted."""
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            client, real_backlog = stack.pool.client, stack.pool.client.backlog

            async def backlog_that_swallows():
                depth = await real_backlog()
                asyncio.current_task().cancel()  # the client leaves as the reply comes ...
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    pass  # ... and the call returns its answer anyway, as redis-py's does
                return depth

            monkeypatch.setattr(client, "backlog", backlog_that_swallows)
            ticket = stack.router.make_request(stack.router.encode_chat(CHAT), SamplingParams(max_tokens=5))
            steps = []

            async def consume():
                async for _, step in stack.router.generate(ticket):
                    steps.append(step)

            task = asyncio.create_task(consume())
            cancelled = False
            try:
                await task
            except asyncio.CancelledError:
                cancelled = True
            stream = await stack.pool.redis.xinfo_stream(stack.pool.keys.admissions)
            return cancelled, steps, stack.router.active, stream["entries-added"]

    cancelled, steps, active, posted = run(main())
    assert cancelled and steps == [] and active == 0 and posted == 0, (cancelled, len(steps), active, posted)


def test_grpc_calls_left_before_their_first_answer_are_cancelled(redis_server, model, tokenizer):
    """A burst of gRPC calls, streams and unary ones, cancelled while their first step waits for the
    verifier: each is freed (its slot, drafter session and KV cache) and counted once as aborted."""
    calls = 8  # of each kind

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), metrics=True) as stack:
            verifier = stack.pool.workers[0]
            async with passes_held(verifier):
                async with grpc.aio.insecure_channel(stack.address) as channel:
                    stub = router_pb2_grpc.RouterStub(channel)
                    message = generate_request(chat=CHAT, max_tokens=400)
                    asking = [*(stub.GenerateStream(message) for _ in range(calls)),
                              *(stub.Generate(message) for _ in range(calls))]
                    await wait_until_async(lambda: stack.router.active == 2 * calls, what="the calls admitted")
                    for call in asking:  # the clients leave before any answer
                        call.cancel()
                    await wait_until_async(lambda: stack.router.active == 0, timeout_s=5.0,
                                           what="the calls left before their first answer left the router")
            # the verifier lets them go between passes, with their drafter sessions: once the pass held ends
            await wait_until_async(lambda: verifier.verifier.num_sessions == 0 and not stack.sessions,
                                   what="the verifier and the drafter hold nothing")
            registry = stack.router.metrics.registry
            return {reason: registry.get_sample_value("specmesh_requests_finished_total", {"reason": reason})
                    for reason in ("aborted", "length", "stop")}

    finished = run(main())
    assert finished == {"aborted": 2 * calls, "length": None, "stop": None}, finished


def test_a_dead_drafter_costs_speculation_not_the_request(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with AsyncClient(stack.address) as client:
                stream = client.stream(chat=CHAT, max_tokens=MAX_TOKENS)
                tokens = list((await stream.__anext__()).token_ids)
                await stack.drafter_server.server.stop(0)  # the drafter node goes away mid-request
                async for chunk in stream:
                    tokens += chunk.token_ids
                after = await client.generate(chat=CHAT, max_tokens=MAX_TOKENS)
            return tokens, after, stack.router.encode_chat(CHAT), stack.drafter_failures

    tokens, after, prompt, failures = run(main())
    assert tokens == plain_greedy(model, prompt, MAX_TOKENS) == after.token_ids
    assert failures >= 1


def test_trees_drafted_ahead_by_a_drafter_service_during_inline_passes_keep_plain_output(redis_server, model,
                                                                                         tokenizer):
    """A CPU verifier (passes on its event loop's thread) drafting ahead: each step's proposals for the next
    tree reach the drafter service before the pass, which drafts them meanwhile (here 20 ms a proposal, 60 ms
    a pass); steps whose verdict confirmed the assumed path take that tree without waiting; the answer is
    plain's."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    plain = plain_greedy(model, prompt, 2 * MAX_TOKENS)

    class SlowOracle(OracleTreeDrafter):
        def propose(self, request_id, budget, assumed=()):
            time.sleep(0.02)
            return super().propose(request_id, budget, assumed)

    drafter = SlowOracle({tuple(prompt): plain}, vocab_size=model.config.vocab_size, seed=2)

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, drafter, inline=True, draft_ahead="on",
                                verifier=lambda runtime: SlowVerifier(runtime, 0.06)) as stack:
            async with AsyncClient(stack.address) as client:
                chunks = [c async for c in client.stream(prompt_ids=prompt, max_tokens=2 * MAX_TOKENS)]
            return chunks, stack.drafter_failures

    chunks, failures = run(main())
    assert [t for c in chunks for t in c.token_ids] == plain
    stats = chunks[-1].stats
    assert 0 < stats.drafted_ahead < stats.target_steps, stats
    unwaited = sum(c.step.draft_ms < 10 for c in chunks if c.step is not None)
    assert unwaited >= stats.drafted_ahead, "a tree drafted ahead was in by the end of the pass"
    assert failures == 0


def test_a_stalled_drafter_holds_no_step_for_its_call_deadline(redis_server, model, tokenizer):
    """A drafter that stops answering (its drafting thread busy for longer than a step, short of its 2 s call
    deadline) costs a step at most a few times its usual answer time; the request goes on without it while
    that proposal is on its way: the stream never waits out the stall, the answer is plain's, and the
    drafter drafts again once back."""
    stall_s = 1.5

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with AsyncClient(stack.address) as client:
                await client.generate(chat=CHAT, max_tokens=MAX_TOKENS)  # the drafter's pace is learnt
                stream = client.stream(chat=CHAT, max_tokens=4 * MAX_TOKENS)
                tokens = list((await stream.__anext__()).token_ids)
                stalled = time.monotonic()
                stall = asyncio.ensure_future(stack.drafter_thread.run(time.sleep, stall_s))
                await asyncio.sleep(0.01)
                gaps, last = [], time.monotonic()
                async for chunk in stream:
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
                    tokens += chunk.token_ids
                streamed_s = time.monotonic() - stalled
                await stall
                await asyncio.sleep(1.0)  # past the first back-off
                after = await client.generate(chat=CHAT, max_tokens=MAX_TOKENS)
            return tokens, after, stack.router.encode_chat(CHAT), gaps, streamed_s

    tokens, after, prompt, gaps, streamed_s = run(main())
    assert tokens == plain_greedy(model, prompt, 4 * MAX_TOKENS)
    assert streamed_s < stall_s, f"the stream waited out the drafter's stall ({streamed_s:.2f} s)"
    assert max(gaps) < 0.5, f"a step waited {max(gaps):.2f} s for the stalled drafter"
    assert after.token_ids == plain_greedy(model, prompt, MAX_TOKENS)
    assert after.stats.drafted_nodes > 0, "the drafter drafts again once it answers in time"


def test_health_and_reflection(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with grpc.aio.insecure_channel(stack.address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="specmesh.v1.Router"), timeout=10)
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                services = [s.name async for a in answers for s in a.list_services_response.service]
            return health.status, services

    status, services = run(main())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert {"specmesh.v1.Router", "grpc.health.v1.Health"} <= set(services)


def test_a_clients_request_id_is_echoed_and_may_repeat(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with AsyncClient(stack.address) as client:
                return await asyncio.gather(*(
                    client.generate(prompt_ids=[5, 6, 7, 5, 6, 7], max_tokens=MAX_TOKENS, request_id="mine")
                    for _ in range(3)
                ))

    results = run(main())
    assert [r.request_id for r in results] == ["mine"] * 3
    assert all(r.token_ids == plain_greedy(model, [5, 6, 7, 5, 6, 7], MAX_TOKENS) for r in results)


def test_a_calls_timeout_bounds_all_its_failover_tries():
    """Two routers with nothing listening, 12 failovers allowed (11 s of back-off between them): a call with
    a 1 s timeout fails UNAVAILABLE about then, unary or streamed, blocking or asyncio."""
    import time

    from specmesh.client import Client
    from specmesh.cluster.ports import free_port

    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]

    def timed(call) -> float:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            call()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        return time.monotonic() - started

    async def timed_async(awaitable) -> float:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            await awaitable
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        return time.monotonic() - started

    async def asynchronous():
        async with AsyncClient(addresses, retries=12, timeout_s=1.0) as client:
            async def stream():
                return [c async for c in client.stream(prompt_ids=[5, 6], max_tokens=4)]
            return [await timed_async(client.generate(prompt_ids=[5, 6], max_tokens=4)), await timed_async(stream())]

    with Client(addresses, retries=12, timeout_s=1.0) as client:
        took = [timed(lambda: client.generate(prompt_ids=[5, 6], max_tokens=4)),
                timed(lambda: list(client.stream(prompt_ids=[5, 6], max_tokens=4)))]
    took += run(asynchronous())
    assert all(t < 2.5 for t in took), took


def test_the_client_retries_unavailable_until_the_router_is_up(redis_server, model, tokenizer):
    """A call made while the router is still starting succeeds once it is up (the channel's retry policy)."""
    from specmesh.cluster.ports import free_port

    port = free_port()

    async def main():
        # everything behind the router is up first: the retries (at most 5 attempts, ~1.5 s) need only
        # outlast the opening of the router's port, not a cluster's start-up on a busy machine
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter()) as stack:
            async with AsyncClient(f"127.0.0.1:{port}", retries=6) as client:
                call = asyncio.ensure_future(client.generate(prompt_ids=[5, 6, 7], max_tokens=4))
                # the first attempt finds nothing listening: the call waits and retries instead of failing
                await wait_until_async(
                    lambda: client._routers.channels[0].get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                    what="a connection attempt failed")
                assert not call.done()
                late = await start_server([stack.router_service], f"127.0.0.1:{port}")
                try:
                    return await asyncio.wait_for(call, 60)
                finally:
                    await late.server.stop(0)

    result = run(main())
    assert result.token_ids == plain_greedy(model, [5, 6, 7], 4)
