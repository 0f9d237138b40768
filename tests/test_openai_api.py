"""The router's OpenAI-compatible HTTP API, served by uvicorn beside the gRPC API over a real local
cluster (a tiny model with the embedded model's tokenizer, a real redis-server, real drafter and router
servers): the official ``openai`` client (sync, async, streaming) gets what plain decoding and the gRPC
API give; stop strings end the answer; bad or hostile requests get OpenAI-shaped errors with the right
status; overload is 429; a client that leaves frees its request; a fuzzer finds no 5xx."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from cluster_parts import ServiceStack, passes_held, plain_greedy
from conftest import wait_until_async
from openai import AsyncOpenAI, OpenAI, RateLimitError

from specmesh.client import AsyncClient
from specmesh.cluster.gateway import GatewayLimits, TextStream
from specmesh.cluster.stops import StopScanner, tokens_through
from specmesh.drafters.ngram import NgramDrafter

MAX_TOKENS = 20
MESSAGES = [{"role": "system", "content": "You repeat."},
            {"role": "user", "content": "Repeat after me: one two three one two three one two three"}]


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_openai_client_gets_what_plain_decoding_and_grpc_give(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), http=True) as stack:
            client = AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0)
            chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                        temperature=0)
            stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            text = await client.completions.create(model="tiny", prompt="one two three one two", max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"speculation": "fixed"})
            blocking = await asyncio.to_thread(_blocking_chat, stack.http_url)
            models = await client.models.list()
            async with AsyncClient(stack.address) as grpc_client:
                over_grpc = await grpc_client.generate(chat=[(m["role"], m["content"]) for m in MESSAGES],
                                                       max_tokens=MAX_TOKENS)
            prompts = stack.router.encode_chat([(m["role"], m["content"]) for m in MESSAGES]), \
                stack.router.encode_text("one two three one two")
            await client.close()
            return chat, chunks, text, blocking, models, over_grpc, prompts

    chat, chunks, text, blocking, models, over_grpc, (chat_prompt, text_prompt) = run(main())
    expected = tokenizer.decode(plain_greedy(model, chat_prompt, MAX_TOKENS), skip_special_tokens=True)
    assert chat.choices[0].message.content == expected == over_grpc.text == blocking
    assert chat.choices[0].finish_reason == "length" and chat.model == "tiny"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(chat_prompt), MAX_TOKENS)
    assert chat.usage.total_tokens == len(chat_prompt) + MAX_TOKENS
    assert chat.model_extra["specmesh"]["target_steps"] >= 1  # the extension: how it was speculated
    # streamed: the role first, the text in pieces, the finish reason, then a usage chunk with no choices
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])
    assert text.choices[0].text == tokenizer.decode(plain_greedy(model, text_prompt, MAX_TOKENS), skip_special_tokens=True)
    assert text.usage.prompt_tokens == len(text_prompt)
    assert [m.id for m in models.data] == ["tiny"]


def _blocking_chat(base_url: str) -> str:
    with OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    return answer.choices[0].message.content


def test_stop_strings_end_the_answer_before_them(redis_server, model, tokenizer):
    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), http=True) as stack:
            client = AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0)
            whole = (await client.completions.create(model="tiny", prompt="one two three", max_tokens=40,
                                                     temperature=0)).choices[0].text
            stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
            cut = await client.completions.create(model="tiny", prompt="one two three", max_tokens=40, temperature=0,
                                                  stop=[stop, "\u2603 never seen"])
            streamed = await client.completions.create(model="tiny", prompt="one two three", max_tokens=40,
                                                       temperature=0, stop=stop, stream=True)
            pieces = [chunk async for chunk in streamed]
            await client.close()
            return whole, stop, cut, pieces

    whole, stop, cut, pieces = run(main())
    assert stop and stop in whole
    before = whole[: whole.index(stop)]
    assert cut.choices[0].text == before and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 40
    assert "".join(p.choices[0].text for p in pieces if p.choices) == before
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_stop_scanner_holds_back_what_may_begin_a_stop_string():
    scanner = StopScanner(["END", "xyz"])
    assert scanner.push("abcE") == "abc"  # "E" may begin "END"
    assert scanner.push("Nd") == "ENd"  # it did not
    assert scanner.push("..EN") == ".."
    assert scanner.push("D tail") == "" and scanner.stopped and scanner.stop_end == len("abcENd..END")
    assert scanner.push("more") == "" and scanner.flush() == ""
    held = StopScanner(["ab"])
    assert held.push("xa") == "x" and held.flush() == "a"
    earliest = StopScanner(["later", "lat"])
    assert earliest.push("a lat") == "a " and earliest.stop_end == 5
    decode = lambda ids: "".join("ab"[i] for i in ids)  # noqa: E731
    assert tokens_through(decode, [0, 1, 0, 1], 3) == 3


def test_a_text_stream_sends_each_character_once_and_decodes_a_window_not_the_answer(tokenizer):
    """Pieces of an answer pushed a few tokens at a time join into its whole text, none holding half a
    character; a stream cut where it held half a character and resumed from its tokens goes on where its
    text stopped; and the tokens decoded grow with the answer, not with its square (each push once read
    the answer so far)."""
    decoded: list[int] = []

    def decode(ids):
        decoded.append(len(ids))
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    ids = tokenizer.encode("Café ☕ — 東京 is Tokyo; 👩‍🚀 and ü, naïve. " * 40, add_special_tokens=False)
    whole = decode(ids)
    for size in (1, 2, 3):
        stream, pieces, held = TextStream(decode), [], []
        decoded.clear()
        for i in range(0, len(ids), size):
            pieces.append(stream.push(ids[i : i + size], final=i + size >= len(ids)))
            if stream.sent < len(stream.tokens):
                held.append((i + size, "".join(pieces)))
        assert "".join(pieces) == whole and not any("\ufffd" in p for p in pieces)
        assert sum(decoded) < 8 * len(ids), (size, sum(decoded), len(ids))
        assert len(held) > 20
        for cut, sent in held[:20]:
            assert sent + TextStream(decode, ids[:cut]).push(ids[cut:], final=True) == whole, (size, cut)


def test_bad_requests_get_openai_errors_naming_the_field(redis_server, model, tokenizer):
    good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    cases = [  # (what is sent, status, param)
        (b'{"model": "tiny", "messages": [', 400, None),  # malformed JSON
        ({**good, "temperature": "hot"}, 400, "temperature"),
        ({**good, "max_tokens": True}, 400, "max_tokens"),
        (json.dumps(good).replace('"temperature": 0', '"temperature": NaN').encode(), 400, "temperature"),
        ({**good, "n": 2}, 400, "n"),
        ({**good, "model": "gpt-4"}, 404, "model"),
        ({**good, "max_tokens": 10**9}, 400, "max_tokens"),
        ({**good, "max_tokens": 10**30}, 400, "max_tokens"),
        ({**good, "logprobs": True}, 400, "logprobs"),
        ({**good, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({**good, "stop": [""]}, 400, "stop[0]"),
        ({**good, "messages": []}, 400, "messages"),
        ({**good, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),  # as the router's own
        ({**good, "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({**good, "seed": 2**70}, 400, "seed"),
        ({**good, "top_p": 0}, 400, "top_p"),
        ({**good, "speculation": "always"}, 400, "speculation"),
        ({**good, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages[0].content"),  # JSON's lone surrogate
        ({**good, "messages": [{"role": "user", "content": "a\u0000b"}]}, 400, "messages[0].content"),
        ({**good, "stop": ["x\udc00"]}, 400, "stop[0]"),
        ({**good, "stop": "\u0000"}, 400, "stop[0]"),
        ([1, 2, 3], 400, "body"),
        (b"", 400, "body"),
        (b"x" * (10 << 20), 413, None),  # 10 MB; the stack's limit is 1 MiB
    ]

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), http=True) as stack:
            base = stack.http_url.removesuffix("/v1")
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                answers = []
                for body, _, _ in cases:
                    content = body if isinstance(body, bytes) else json.dumps(body).encode()
                    answers.append(await http.post("/v1/chat/completions", content=content,
                                                   headers={"content-type": "application/json"}))
                answers.append(await http.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"]}))
                answers.append(await http.post("/v1/completions", json={"model": "tiny", "prompt": [10**9]}))
                answers.append(await http.post("/v1/completions", headers={"content-type": "application/json"},
                                               content=json.dumps({"model": "tiny", "prompt": "a\udfffb"}).encode()))
                async def chunks():  # no Content-Length: the limit is met while the body streams in
                    for _ in range(40):
                        yield b"x" * (64 << 10)
                answers.append(await http.post("/v1/chat/completions", content=chunks()))
                answers.append(await http.get("/v1/nothing"))
                answers.append(await http.get("/v1/models/gpt-4"))
                health = await http.get("/health")
                ok = await http.post("/v1/chat/completions", json=good)
            return answers, health, ok

    answers, health, ok = run(main())
    expected = [(status, param) for _, status, param in cases] + [(400, "prompt"), (400, "prompt"), (400, "prompt"), (413, None),
                                                                   (404, None), (404, None)]
    for answer, (status, param) in zip(answers, expected):
        error = answer.json()["error"]
        assert answer.status_code == status, (answer.status_code, error)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert error["param"] == param, error
    assert health.status_code == 200 and health.json() == {"status": "ok", "verifiers": 1}
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_overload_is_429_and_a_client_that_leaves_frees_its_request(redis_server, model, tokenizer):
    async def main():
        limits = GatewayLimits(max_concurrent=1, max_tree_nodes=6, speculation="fixed")
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), limits, metrics=True,
                                http=True) as stack:
            client = AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0)
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True}
            async with httpx.AsyncClient(base_url=stack.http_url.removesuffix("/v1"), timeout=30) as http:
                async with http.stream("POST", "/v1/chat/completions", json=body) as first:
                    lines = first.aiter_lines()
                    while not (await anext(lines)).startswith("data:"):
                        pass  # under way, holding the only slot
                    with pytest.raises(RateLimitError) as refused:
                        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)

                    def held():
                        return stack.router.active, len(stack.sessions), stack.pool.workers[0].verifier.num_sessions

                    held_while_streaming = held()
                # the client walked away mid-stream
                await wait_until_async(lambda: held() == (0, 0, 0), what="the abandoned request freed everything")
                metrics = (await http.get(stack.metrics_urls["router"])).text
                again = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
            await client.close()
            return refused.value, held_while_streaming, metrics, again

    refused, held_while_streaming, metrics, again = run(main())
    assert refused.status_code == 429 and "limit" in refused.message
    assert held_while_streaming[0] == 1 and held_while_streaming[2] == 1, held_while_streaming
    assert "specmesh_requests_in_flight 0.0" in metrics
    # ended by the disconnect ("aborted"), unless the tiny model finished all 400 tokens before the router
    # heard of it: either way ended, and counted once
    finished = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("specmesh_requests_finished_total{")}
    assert sum(finished.values()) == 1.0 and set(finished) <= {"aborted", "length"}, finished
    assert again.usage.completion_tokens == 4


def test_streams_left_before_their_first_chunk_are_cancelled(redis_server, model, tokenizer):
    streams = 16  # a burst, as a client that gives up on a slow start does

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), http=True) as stack:
            verifier = stack.pool.workers[0]
            async with passes_held(verifier):
                body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "stream": True}
                limits = httpx.Limits(max_connections=streams)
                async with httpx.AsyncClient(base_url=stack.http_url.removesuffix("/v1"), timeout=30, limits=limits) as http:
                    asking = [asyncio.ensure_future(http.post("/v1/chat/completions", json=body)) for _ in range(streams)]
                    await wait_until_async(lambda: stack.router.active == streams, what="the requests admitted")
                    for request in asking:  # the clients leave while the first step waits: connections close
                        request.cancel()
                    await asyncio.gather(*asking, return_exceptions=True)
                    await wait_until_async(lambda: stack.router.active == 0, timeout_s=5.0,
                                           what="the requests left before their first chunk were freed")  # no timeout's doing
            # the verifier lets them go between passes, with their drafter sessions: once the pass held ends
            await wait_until_async(lambda: verifier.verifier.num_sessions == 0 and not stack.sessions,
                                   what="the verifier and the drafter hold nothing")

    run(main())


class _StackThread:
    """A ServiceStack on an event loop of its own thread, for clients that block (the fuzzer)."""

    def __init__(self, *args, **kwargs) -> None:
        self.stack = ServiceStack(*args, **kwargs)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ServiceStack:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.stack.__aenter__(), self.loop).result(timeout=120)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.stack.__aexit__(None, None, None), self.loop).result(timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def test_a_fuzzer_on_the_served_schema_finds_no_server_error(redis_server, model, tokenizer):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    with _StackThread(redis_server.url, model, tokenizer, NgramDrafter(), http=True) as stack:
        base = stack.http_url.removesuffix("/v1")
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        checked, statuses = 0, []
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

                @settings(max_examples=30, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(mode))
                def exchange(case):
                    response = case.call_and_validate(base_url=base, timeout=60, checks=[
                        not_a_server_error, status_code_conformance, content_type_conformance,
                        response_schema_conformance])
                    statuses.append(response.status_code)
                    if response.status_code >= 400:  # OpenAI's error shape, always
                        assert set(response.json()["error"]) == {"message", "type", "param", "code"}

                try:
                    exchange()
                except Unsatisfiable:  # no input to break (GET /health): nothing negative to send
                    assert mode == schemathesis.GenerationMode.NEGATIVE
            checked += 1
        health = httpx.get(f"{base}/health", timeout=10)
    assert checked == 5
    assert {200, 400, 404} <= set(statuses)  # it reached generation as well as every kind of refusal
    assert health.status_code == 200
