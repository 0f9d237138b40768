"""ProposeMany: the proposals a drafter service is asked for in one event-loop turn travel in one call,
each item answered alone. A real drafter service over loopback and the router's adapter (RemoteDrafter),
no mocks: the calls are counted by the service's own metrics, or by a server interceptor where the
service is an older one without the method."""

import asyncio
import collections
import threading
import time
from contextlib import asynccontextmanager

import grpc
import pytest
from conftest import wait_until_async

from specmesh.cluster.drafter_sessions import MAX_PROPOSE_ITEMS, DrafterSessions
from specmesh.cluster.metrics import DrafterMetrics
from specmesh.cluster.proposal_stream import ProposalStream
from specmesh.cluster.remote_drafter import MAX_CALL_BYTES, RemoteDrafter, _chunks
from specmesh.cluster.serving import ErrorInterceptor, Service, TorchThread, start_server
from specmesh.cluster.wire import tree_from_pb
from specmesh.drafters.ngram import NgramDrafter
from specmesh.services.drafter.server import DrafterServicer
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

VOCAB = 100
N = 8
BUDGET = 4


def rid(i: int) -> str:
    return f"request-{i}"


def prompt(i: int) -> list[int]:
    return [10 + i, 20 + i, 30 + i, 10 + i, 20 + i]  # prompt lookup drafts 30+i, 10+i, 20+i ...


def commits(i: int) -> list[int]:
    return [30 + i, 10 + i]


def info(opens_in_propose: bool = True, proposes_in_stream: bool = True) -> drafter_pb2.DrafterInfo:
    return drafter_pb2.DrafterInfo(name="ngram", kind="ngram", domains=["general"], tokenizer_hash="h",
                                   opens_in_propose=opens_in_propose, proposes_in_stream=proposes_in_stream)


@asynccontextmanager
async def drafter_service(drafter=None, max_sessions: int = 64, opens_in_propose: bool = True,
                          proposes_in_stream: bool = True):
    """A drafter service on a free loopback port, as specmesh-drafter serves it: its metrics count its calls;
    ``opens_in_propose`` False: as drafters before v1.4 (sessions opened by OpenSession alone);
    ``proposes_in_stream`` False: as drafters before v1.5 (its card offers no proposal stream)."""
    metrics = DrafterMetrics()
    sessions = DrafterSessions(drafter or NgramDrafter(), VOCAB, max_sessions)
    servicer = DrafterServicer(sessions, info(opens_in_propose, proposes_in_stream), TorchThread("draft"), metrics)
    server = await start_server(
        [Service("specmesh.v1.Drafter", lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s))],
        "127.0.0.1:0", metrics=metrics)
    try:
        yield f"127.0.0.1:{server.port}", metrics
    finally:
        await server.server.stop(0)


def calls(metrics: DrafterMetrics, method: str, code: str = "OK") -> float:
    return metrics.registry.get_sample_value("specmesh_rpc_requests_total", {"method": method, "code": code}) or 0.0


def batch_items(metrics: DrafterMetrics) -> tuple[float, float]:
    """(ProposeMany messages, calls or on the stream; items in them) as the batch histogram has them."""
    get = metrics.registry.get_sample_value
    labels = {"drafter": "ngram"}
    return (get("specmesh_drafter_propose_batch_items_count", labels) or 0.0,
            get("specmesh_drafter_propose_batch_items_sum", labels) or 0.0)


async def connected(address: str, timeout_s: float = 10.0) -> RemoteDrafter:
    remote = RemoteDrafter(address, timeout_s=timeout_s)
    assert await remote.connect("h")
    for i in range(N):
        await remote.start(rid(i), prompt(i))
    return remote


async def propose_all(remote: RemoteDrafter, **kwargs) -> list:
    return list(await asyncio.gather(*(remote.propose(rid(i), BUDGET, **kwargs.get(rid(i), {})) for i in range(N))))


async def single_calls() -> tuple[list, list]:
    """What N plain Propose calls draft: each request opened and asked, then told its commits and asked again."""
    async with drafter_service() as (address, _):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            first, second = [], []
            for i in range(N):
                await stub.OpenSession(drafter_pb2.OpenSessionRequest(request_id=rid(i), prompt_ids=prompt(i)),
                                       timeout=10)
                for committed, trees in (([], first), (commits(i), second)):
                    answer = await stub.Propose(
                        drafter_pb2.ProposeRequest(request_id=rid(i), committed=committed, budget=BUDGET), timeout=10)
                    trees.append(tree_from_pb(answer.tree))
    return first, second


@pytest.fixture(scope="module")
def reference():
    first, second = asyncio.run(single_calls())
    assert all(len(t) for t in first + second) and first != second
    return first, second


async def commit_all(remote: RemoteDrafter) -> None:
    for i in range(N):
        await remote.commit(rid(i), commits(i))


@pytest.mark.parametrize("opens_in_propose, in_stream", [(True, True), (True, False), (False, False)],
                         ids=["on the proposal stream", "a call a turn (before v1.5)", "before v1.4"])
def test_a_turns_proposals_go_in_one_message_and_draft_what_single_calls_do(reference, opens_in_propose, in_stream):
    async def main():
        async with drafter_service(opens_in_propose=opens_in_propose, proposes_in_stream=in_stream) as (address, metrics):
            remote = await connected(address)
            first = await propose_all(remote)  # each session opened with its first proposal, or by a call before it
            await commit_all(remote)
            before = batch_items(metrics)
            second = await propose_all(remote)
            after = batch_items(metrics)
            await remote.close()
            return (first, second, before, after, calls(metrics, "Propose"), calls(metrics, "OpenSession"),
                    calls(metrics, "ProposeMany"), calls(metrics, "ProposeStream"))

    first, second, before, after, single, opened, unary, streams = asyncio.run(main())
    assert (first, second) == reference
    assert (after[0] - before[0], after[1] - before[1]) == (1, N)  # one message for the turn's N proposals
    assert single == 0
    # every turn a message on the held stream (each counted as a call), or a call
    assert (unary, streams) == ((0, after[0]) if in_stream else (after[0], 0))
    # the first turn: one message that opens every session, or N calls to open them, each request's proposal
    # sent in the turn its open was answered in
    if opens_in_propose:
        assert (before[0], opened) == (1, 0)
    else:
        assert opened == N and before[0] >= 1


def test_a_session_the_drafter_lost_is_reopened_and_answered_with_the_others(reference):
    lost = 3

    async def main():
        async with drafter_service(max_sessions=N) as (address, metrics):
            remote = await connected(address)
            await propose_all(remote)
            await commit_all(remote)
            async with grpc.aio.insecure_channel(address) as channel:  # the drafter evicts one session:
                stub = drafter_pb2_grpc.DrafterStub(channel)  # the others used since, then one more opened
                for i in range(N):
                    if i != lost:
                        await stub.Propose(drafter_pb2.ProposeRequest(request_id=rid(i), budget=0), timeout=10)
                await stub.OpenSession(drafter_pb2.OpenSessionRequest(request_id="another", prompt_ids=[1, 2]),
                                       timeout=10)
            before = batch_items(metrics)[0], calls(metrics, "OpenSession"), batch_items(metrics)[1]
            second = await propose_all(remote)
            after = batch_items(metrics)[0], calls(metrics, "OpenSession"), batch_items(metrics)[1]
            await remote.close()
            return second, before, after, remote.failures

    second, before, after, failures = asyncio.run(main())
    assert second == reference[1]
    # the turn's message, then the lost one's item again, opening its session afresh with its whole context
    assert [a - b for a, b in zip(after, before)] == [2, 0, N + 1]
    assert failures == 0


def test_an_invalid_item_fails_alone(reference):
    bad = 5

    async def main():
        async with drafter_service() as (address, metrics):
            remote = await connected(address)
            await propose_all(remote)
            await commit_all(remote)
            before = batch_items(metrics)[0]
            second = await propose_all(remote, **{rid(bad): {"assumed": [VOCAB + 7]}})  # outside the vocabulary
            one_call = batch_items(metrics)[0] - before
            healthy = remote.healthy
            again = await remote.propose(rid(bad), BUDGET)  # its session opened afresh: it may have run there
            await remote.close()
            return second, one_call, healthy, again

    second, one_call, healthy, again = asyncio.run(main())
    assert len(second[bad]) == 0 and again == reference[1][bad]
    assert [t for i, t in enumerate(second) if i != bad] == [t for i, t in enumerate(reference[1]) if i != bad]
    assert one_call == 1 and healthy  # a refused item is no reason to leave the drafter alone


def test_each_item_gets_its_own_status_and_too_many_items_are_refused_naming_the_bound():
    async def main():
        async with drafter_service() as (address, _):
            async with grpc.aio.insecure_channel(address) as channel:
                stub = drafter_pb2_grpc.DrafterStub(channel)
                await stub.OpenSession(drafter_pb2.OpenSessionRequest(request_id="r", prompt_ids=prompt(0)), timeout=10)
                reply = await stub.ProposeMany(drafter_pb2.ProposeManyRequest(items=[
                    drafter_pb2.ProposeRequest(request_id="r", budget=BUDGET),
                    drafter_pb2.ProposeRequest(request_id="nobody", budget=BUDGET),
                    drafter_pb2.ProposeRequest(request_id="r", committed=[VOCAB], budget=BUDGET),
                ]), timeout=10)
                too_many = [drafter_pb2.ProposeRequest(request_id="r", budget=BUDGET)] * (MAX_PROPOSE_ITEMS + 1)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ProposeMany(drafter_pb2.ProposeManyRequest(items=too_many), timeout=10)
                return reply, refused.value

    reply, refused = asyncio.run(main())
    codes = [grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT]
    assert [r.code for r in reply.results] == [c.value[0] for c in codes]
    assert list(reply.results[0].answer.tree.tokens)[:1] == [30]
    assert "nobody" in reply.results[1].message and reply.results[2].message.startswith("committed:")
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("items:") and str(MAX_PROPOSE_ITEMS) in refused.details()


class MethodCounter(grpc.aio.ServerInterceptor):
    """Counts the calls a server receives by method, answered or not."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    async def intercept_service(self, continuation, handler_call_details):
        self.calls[handler_call_details.method.rsplit("/", 1)[-1]] += 1
        return await continuation(handler_call_details)


def before_propose_many(servicer) -> grpc.GenericRpcHandler:
    """The Drafter service as drafters before v1.3 served it: no ProposeMany."""
    messages = {"OpenSession": (drafter_pb2.OpenSessionRequest, drafter_pb2.OpenSessionResponse),
                "Propose": (drafter_pb2.ProposeRequest, drafter_pb2.ProposeResponse),
                "CloseSession": (drafter_pb2.CloseSessionRequest, drafter_pb2.CloseSessionResponse),
                "Info": (drafter_pb2.DrafterInfoRequest, drafter_pb2.DrafterInfo)}
    return grpc.method_handlers_generic_handler("specmesh.v1.Drafter", {
        name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name), request_deserializer=request.FromString,
                                                  response_serializer=response.SerializeToString)
        for name, (request, response) in messages.items()})


def test_a_drafter_without_propose_many_is_called_once_a_proposal_from_then_on(reference):
    async def main():
        counter = MethodCounter()
        server = grpc.aio.server(interceptors=[counter, ErrorInterceptor()])
        servicer = DrafterServicer(DrafterSessions(NgramDrafter(), VOCAB, 64), info(False, False), TorchThread("draft"))
        server.add_generic_rpc_handlers((before_propose_many(servicer),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            remote = await connected(f"127.0.0.1:{port}")
            first = await propose_all(remote)
            await commit_all(remote)
            before = dict(counter.calls)
            second = await propose_all(remote)
            after = dict(counter.calls)
            await remote.close()
        finally:
            await server.stop(0)
        return first, second, before, after, remote.failures

    first, second, before, after, failures = asyncio.run(main())
    assert (first, second) == reference and failures == 0  # UNIMPLEMENTED is not a drafter down
    assert before["ProposeMany"] >= 1 and before["Propose"] == N  # refused, then each proposal alone
    assert after["ProposeMany"] == before["ProposeMany"] and after["Propose"] == 2 * N


class HeldNgram(NgramDrafter):
    """Prompt lookup that, once armed, holds its next proposal until released (a drafter busy with a call)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.busy = threading.Event()
        self.release = threading.Event()
        self.starts = 0  # sessions opened

    def start(self, request_id, prompt_ids):
        self.starts += 1
        super().start(request_id, prompt_ids)

    def propose(self, request_id, budget, assumed=()):
        if self.armed:
            self.armed = False
            self.busy.set()
            self.release.wait(10)
        return super().propose(request_id, budget, assumed)


def test_a_cancelled_caller_leaves_the_others_answered(reference):
    early, late = 0, 1

    async def main():
        drafter = HeldNgram()
        async with drafter_service(drafter) as (address, metrics):
            remote = await connected(address)
            first = await propose_all(remote)
            drafter.armed = True
            opened, items = drafter.starts, batch_items(metrics)[1]
            tasks = [asyncio.create_task(remote.propose(rid(i), BUDGET)) for i in range(N)]
            await asyncio.sleep(0)  # each has asked; the turn's call is not sent yet
            tasks[early].cancel()
            await wait_until_async(drafter.busy.is_set, what="the call reached the drafter")
            tasks[late].cancel()
            await asyncio.sleep(0.05)
            drafter.release.set()
            answers = await asyncio.gather(*tasks, return_exceptions=True)
            sent = batch_items(metrics)[1] - items
            again = await propose_all(remote)  # a cancelled caller's session is opened afresh: it may have run
            reopened = drafter.starts - opened
            await remote.close()
            return first, answers, sent, again, reopened

    first, answers, sent, again, reopened = asyncio.run(main())
    assert isinstance(answers[early], asyncio.CancelledError) and isinstance(answers[late], asyncio.CancelledError)
    assert [a for i, a in enumerate(answers) if i not in (early, late)] == [
        t for i, t in enumerate(first) if i not in (early, late)]
    assert first == reference[0] and again == reference[0]
    assert sent == N - 1  # the caller gone before the call left no item in it
    assert reopened == 2


def test_a_drafter_that_is_gone_fails_the_turns_call_once_and_is_left_alone():
    async def main():
        async with drafter_service() as (address, _):
            remote = await connected(address, timeout_s=1.0)
            await propose_all(remote)
        started = time.monotonic()  # the service has stopped
        trees = await propose_all(remote)
        seconds = time.monotonic() - started
        skipped = await propose_all(remote)  # in back-off: not even a call
        await remote.close()
        return trees, seconds, remote.failures, remote.healthy, skipped

    trees, seconds, failures, healthy, skipped = asyncio.run(main())
    assert all(len(t) == 0 for t in trees + skipped)
    assert failures == 1 and not healthy and seconds < 5


def test_a_turn_past_the_bounds_goes_in_several_calls():
    many = MAX_PROPOSE_ITEMS + 44

    async def main():
        async with drafter_service(max_sessions=many) as (address, metrics):
            remote = RemoteDrafter(address, timeout_s=30)
            assert await remote.connect("h")
            for i in range(many):
                await remote.start(rid(i), prompt(i % N))
            await asyncio.gather(*(remote.propose(rid(i), BUDGET) for i in range(many)))  # sessions opened
            before = batch_items(metrics)
            trees = await asyncio.gather(*(remote.propose(rid(i), BUDGET) for i in range(many)))
            after = batch_items(metrics)
            await remote.close()
            return trees, (after[0] - before[0], after[1] - before[1])

    trees, (calls_made, items) = asyncio.run(main())
    assert all(len(t) for t in trees)
    assert (calls_made, items) == (2, many)
    # a feature drafter's first blocks are big: a call stops at MAX_CALL_BYTES, a bigger item goes alone
    big = drafter_pb2.ProposeRequest(request_id="r", features=common_pb2.Features(data=b"\0" * (MAX_CALL_BYTES // 2)))
    small = drafter_pb2.ProposeRequest(request_id="s")
    assert [len(c) for c in _chunks([(big, None), (small, None), (big, None), (big, None)])] == [2, 1, 1]


def test_on_the_stream_a_reply_past_its_deadline_fails_its_turn_alone_and_the_next_meet_their_own(reference):
    async def main():
        drafter = HeldNgram()
        async with drafter_service(drafter) as (address, metrics):
            remote = RemoteDrafter(address, timeout_s=0.5, max_backoff_s=0.05)
            assert await remote.connect("h")
            for i in range(N):
                await remote.start(rid(i), prompt(i))
            first = await propose_all(remote)
            drafter.armed = True  # the next turn's reply comes after its deadline
            late = await propose_all(remote)
            failures = remote.failures
            drafter.release.set()
            await wait_until_async(lambda: batch_items(metrics)[0] == 2 and remote.healthy, what="the late reply sent")
            again = await propose_all(remote)  # on the same stream: the late reply read and dropped before this one's
            await remote.close()
            return first, late, failures, again

    first, late, failures, again = asyncio.run(main())
    assert first == reference[0] and all(len(t) == 0 for t in late) and failures == 1
    assert again == reference[0]  # its sessions opened afresh (the late turn may have run there): the first trees


def test_on_the_stream_each_reply_meets_its_message_while_the_loop_stands_still():
    """A verifier's pass holds its event loop: the write's completion and the reply then wait together, and
    either may be handled first. Each message (of a different size) must still get its own reply."""

    async def main():
        async with drafter_service(max_sessions=64) as (address, _):
            async with grpc.aio.insecure_channel(address) as channel:
                stream = ProposalStream(drafter_pb2_grpc.DrafterStub(channel), timeout_s=5.0)
                sizes = []
                for turn in range(60):
                    items = [drafter_pb2.ProposeRequest(request_id=rid(i), committed=prompt(i), budget=BUDGET,
                                                        opens=True) for i in range(1 + turn % 7)]
                    asking = asyncio.ensure_future(stream.propose_many(drafter_pb2.ProposeManyRequest(items=items)))
                    for _ in range(turn % 3):
                        await asyncio.sleep(0)  # written: its reply is on its way
                    time.sleep(0.002 * (turn % 4))  # the loop stands still, as during an inline pass
                    sizes.append((len(items), len((await asking).results)))
                await stream.close()
                return sizes

    sizes = asyncio.run(main())
    assert all(sent == answered for sent, answered in sizes), sizes
