"""The soak's traffic, for locust: mixed requests through the router's gRPC API (the SDK) and its
OpenAI-compatible HTTP API — unary and streaming, greedy and seeded sampling, cancellations and
invalid requests. Every answer is checked against the references the driver computed in its own process
(greedy: plain decoding; seeded sampling without speculation: plain sampling with the same seed) and
written, one JSON line a request, to $SOAK_RESULTS; the driver (tests/soak/run.py) makes the report from
those lines (speculative sampling's answers are judged there, together).

Started by the driver: locust -f tests/soak/locustfile.py --headless ... with SOAK_* variables set.
"""

import json
import os
import random
import time

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel: gRPC's completion queue cooperates with locust's greenlets

import grpc  # noqa: E402
import requests  # noqa: E402
from locust import HttpUser, User, between, events, task  # noqa: E402

from specmesh.client import Client  # noqa: E402

REFERENCES = json.loads(open(os.environ["SOAK_REFERENCES"]).read())
RESULTS = open(os.environ["SOAK_RESULTS"], "a", buffering=1)
ROUTERS = os.environ["SOAK_ROUTER"]  # every router's gRPC address, comma-separated: the SDK fails over
HTTP_BASES = os.environ.get("SOAK_HTTP", "http://127.0.0.1:8000").split(",")  # each router's HTTP API
DEADLINE_S = float(os.environ.get("SOAK_DEADLINE_S", "120"))  # past this a request counts as hung
GREEDY, SAMPLED = REFERENCES["greedy"], REFERENCES["sampled"]
SAMPLED_TOKENS, TEMPERATURE = REFERENCES["sampled_max_tokens"], REFERENCES["temperature"]


DISTRIBUTION = REFERENCES["distribution"]  # speculative sampling's prompts, judged by the whole answers' frequencies


def record(kind: str, started: float, status: str, check: str = "none", api: str = "grpc", via: str = "",
           **more) -> None:
    """One request's outcome: its status (OK, a gRPC status name, HTTP_<code>, HTTP_CONNECTION), whether its
    output was right (ok / wrong / none: judged apart, or not at all), when it ran, (HTTP) which router it
    went to, and ``more`` (a sampled answer's prompt and tokens)."""
    ended = time.time()
    RESULTS.write(json.dumps({"kind": kind, "api": api, "start": started, "end": ended, "status": status,
                              "check": check, "via": via, **more}) + "\n")
    failed = status not in ("OK", "EXPECTED", "CANCELLED_BY_CLIENT")
    events.request.fire(request_type=api, name=kind, response_time=(ended - started) * 1e3, response_length=0,
                        exception=RuntimeError(status) if failed else None, context={})


def status_of(exc: grpc.RpcError) -> str:
    return "HUNG" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else exc.code().name


class GrpcUser(User):
    """A client of the router's gRPC API through the SDK."""

    wait_time = between(0.1, 0.5)
    weight = 3

    def on_start(self) -> None:
        # a call goes on at the other router when one is down (and a cut stream resumes there); otherwise
        # no retries, so that every failure is the soak's to judge
        self.client = Client(ROUTERS, timeout_s=DEADLINE_S, retries=len(ROUTERS.split(",")) - 1)

    def on_stop(self) -> None:
        self.client.close()

    def _call(self, kind: str, call) -> None:
        """Time ``call()`` (returns the output's check: ok, wrong or none; or (none, what to record)) and
        record its outcome."""
        started = time.time()
        try:
            check = call()
            check, more = check if isinstance(check, tuple) else (check, {})
            record(kind, started, "OK", check, **more)
        except grpc.RpcError as exc:
            record(kind, started, status_of(exc))

    @task(4)
    def unary_greedy(self) -> None:
        case = random.choice(GREEDY)

        def call() -> str:
            answer = self.client.generate(chat=[("user", case["prompt"])], max_tokens=case["max_tokens"], temperature=0)
            return "ok" if list(answer.token_ids) == case["tokens"] else "wrong"

        self._call("grpc_unary_greedy", call)

    @task(4)
    def stream_greedy(self) -> None:
        case = random.choice(GREEDY)

        def call() -> str:
            tokens = []
            for chunk in self.client.stream(chat=[("user", case["prompt"])], max_tokens=case["max_tokens"], temperature=0):
                tokens += chunk.token_ids
            return "ok" if tokens == case["tokens"] else "wrong"

        self._call("grpc_stream_greedy", call)

    @task(2)
    def seeded_sampling(self) -> None:
        case = random.choice(SAMPLED)

        def call() -> str:
            answer = self.client.generate(chat=[("user", case["prompt"])], max_tokens=SAMPLED_TOKENS,
                                          temperature=TEMPERATURE, seed=case["seed"], speculation="off")
            return "ok" if list(answer.token_ids) == case["tokens"] else "wrong"

        self._call("grpc_seeded_sampling", call)

    @task(2)
    def sampling(self) -> None:  # speculative sampling: its whole answers are judged together, by their frequencies
        index = random.randrange(len(DISTRIBUTION["prompts"]))

        def call():
            answer = self.client.generate(chat=[("user", DISTRIBUTION["prompts"][index])],
                                          max_tokens=DISTRIBUTION["max_tokens"], temperature=TEMPERATURE,
                                          speculation="fixed")
            return "none", {"prompt_index": index, "tokens": list(answer.token_ids),
                            "accepted": answer.stats.accepted_tokens}

        self._call("grpc_sampling", call)

    @task(1)
    def cancelled_stream(self) -> None:
        started = time.time()
        stream = self.client.stream(chat=[("user", random.choice(GREEDY)["prompt"])], max_tokens=SAMPLED_TOKENS)
        try:
            next(stream)  # the first chunk, then the client leaves
            stream.close()  # the SDK cancels the call
            record("grpc_cancelled_stream", started, "CANCELLED_BY_CLIENT")
        except StopIteration:
            record("grpc_cancelled_stream", started, "OK")
        except grpc.RpcError as exc:
            record("grpc_cancelled_stream", started, status_of(exc))

    @task(1)
    def invalid(self) -> None:
        started = time.time()
        try:
            self.client.generate(prompt_ids=[5, -1, 7], max_tokens=4)
            record("grpc_invalid", started, "OK_BUT_INVALID")
        except grpc.RpcError as exc:
            record("grpc_invalid", started, "EXPECTED" if exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                   else status_of(exc))


def http_status(response) -> str:
    """A failed HTTP request's status: HTTP_<code>, HUNG (past the deadline), or HTTP_CONNECTION (refused or
    cut: its router died)."""
    if response.status_code:
        return f"HTTP_{response.status_code}"
    return "HUNG" if isinstance(response.error, requests.Timeout) else "HTTP_CONNECTION"


class OpenAIUser(HttpUser):
    """A client of the OpenAI-compatible HTTP API (locust's HTTP client), each request to a router at random:
    an OpenAI client has no failover of ours, so a router's death is a clean error it retries itself."""

    wait_time = between(0.1, 0.5)
    weight = 2
    host = HTTP_BASES[0]

    def _post(self, base: str, body: dict, stream: bool = False):
        return self.client.post(f"{base}/v1/chat/completions", json=body, stream=stream, timeout=DEADLINE_S,
                                name="chat" + ("-stream" if stream else ""), catch_response=True)

    @task(3)
    def chat_greedy(self) -> None:
        case, base = random.choice(GREEDY), random.choice(HTTP_BASES)
        started = time.time()
        with self._post(base, {"model": REFERENCES["model"], "messages": [{"role": "user", "content": case["prompt"]}],
                               "max_tokens": case["max_tokens"], "temperature": 0}) as response:
            response.success()  # judged here, not by locust
            if response.status_code == 200:
                text = response.json()["choices"][0]["message"]["content"]
                record("http_chat_greedy", started, "OK", "ok" if text == case["text"] else "wrong", "http", base)
            else:
                record("http_chat_greedy", started, http_status(response), api="http", via=base)

    @task(3)
    def chat_stream_greedy(self) -> None:
        case, base = random.choice(GREEDY), random.choice(HTTP_BASES)
        started = time.time()
        with self._post(base, {"model": REFERENCES["model"], "messages": [{"role": "user", "content": case["prompt"]}],
                               "max_tokens": case["max_tokens"], "temperature": 0, "stream": True},
                        stream=True) as response:
            response.success()
            if response.status_code != 200:
                record("http_stream_greedy", started, http_status(response), api="http", via=base)
                return
            text, error = [], None
            try:
                for line in response.iter_lines():
                    line = line.decode() if isinstance(line, bytes) else line
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = "STREAM_" + (event["error"].get("code") or event["error"].get("type") or "error")
                        break
                    text += [c["delta"].get("content") or "" for c in event.get("choices", [])]
            except requests.RequestException:  # the stream cut: its router died
                error = "HTTP_CONNECTION"
            if error:
                record("http_stream_greedy", started, error, api="http", via=base)
            else:
                record("http_stream_greedy", started, "OK", "ok" if "".join(text) == case["text"] else "wrong",
                       "http", base)

    @task(1)
    def invalid(self) -> None:
        base = random.choice(HTTP_BASES)
        started = time.time()
        with self._post(base, {"model": REFERENCES["model"], "messages": [{"role": "user", "content": "hi"}],
                               "n": 2}) as response:
            response.success()
            record("http_invalid", started, "EXPECTED" if response.status_code == 400 else http_status(response),
                   api="http", via=base)
