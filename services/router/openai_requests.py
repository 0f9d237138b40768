"""The OpenAI API's requests read: a chat or text completion's body turned into the gateway's ticket (the
same validation as the gRPC servicer's: ``Gateway.make_request``), with OpenAI's defaults, and every field
whose meaning specmesh does not implement refused by name rather than ignored."""

from __future__ import annotations

import time

from specmesh import __version__
from specmesh.cluster.gateway import Gateway, Ticket
from specmesh.cluster.stops import check_stops
from specmesh.errors import InvalidArgument
from specmesh.prompts import check_text
from specmesh.sampling import SamplingParams
from specmesh.services.router.openai_errors import ModelNotFound
from specmesh.services.router.openai_schema import ChatCompletionRequest, CompletionRequest, Model, SamplingFields

ROLE_OF = {"developer": "system"}  # OpenAI's newer name for the system role


def refuse_unsupported(body: SamplingFields) -> None:
    """Fields whose meaning specmesh does not implement are refused rather than ignored."""
    if body.n not in (None, 1):
        raise InvalidArgument("n", f"only 1 choice per request is served, got {body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise InvalidArgument(name, "is not supported (only 0): speculation keeps the target's own distribution")
    if body.logit_bias:
        raise InvalidArgument("logit_bias", "is not supported")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs:
            raise InvalidArgument("logprobs", "log-probabilities are not returned by specmesh")
        for name in ("tools", "functions"):
            if getattr(body, name):
                raise InvalidArgument(name, "tool and function calls are not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(body, name) not in (None, "none"):
                raise InvalidArgument(name, "tool and function calls are not supported")
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise InvalidArgument("echo", "is not supported")
        if body.suffix is not None:
            raise InvalidArgument("suffix", "is not supported")
        if body.best_of not in (None, 1):
            raise InvalidArgument("best_of", f"only 1 is served, got {body.best_of}")
        if body.logprobs is not None:
            raise InvalidArgument("logprobs", "log-probabilities are not returned by specmesh")


def stop_strings(body: SamplingFields) -> tuple[str, ...]:
    if body.stop is None:
        return ()
    return check_stops([body.stop] if isinstance(body.stop, str) else body.stop)


class OpenAIFrontend:
    """Turns OpenAI requests into the gateway's tickets; names the model and the system."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.created = int(time.time())
        self.fingerprint = f"specmesh-{__version__}-{gateway.card.tokenizer_hash[:8]}"

    @property
    def name(self) -> str:
        """The one model served."""
        return self.gateway.card.name

    def model(self) -> Model:
        card = self.gateway.card
        return Model(id=card.name, created=self.created, max_model_len=card.max_length)

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise ModelNotFound(f"model {name!r} is not served here; this router serves {self.name!r}")

    def sampling(self, body: SamplingFields, max_tokens: int | None) -> SamplingParams:
        refuse_unsupported(body)
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
            top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
            max_tokens=max_tokens or self.gateway.limits.default_max_tokens,
        )

    def chat_ticket(self, body: ChatCompletionRequest) -> Ticket:
        self.check_model(body.model)
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise InvalidArgument("max_completion_tokens", "differs from max_tokens; give one")
        params = self.sampling(body, body.max_completion_tokens or body.max_tokens)
        for i, message in enumerate(body.messages):
            if message.role == "assistant" and message.content is None:
                raise InvalidArgument(f"messages[{i}].content", "is missing")
        messages = [(ROLE_OF.get(m.role, m.role), m.text()) for m in body.messages]
        for i, (_, text) in enumerate(messages):
            check_text(f"messages[{i}].content", text)
        user = next((text for role, text in reversed(messages) if role == "user"), "")
        return self.gateway.make_request(self.gateway.encode_chat(messages), params, max_tree_nodes=body.max_tree_nodes,
                                        text=user, speculation=body.speculation)

    def completion_ticket(self, body: CompletionRequest) -> Ticket:
        self.check_model(body.model)
        params = self.sampling(body, body.max_tokens)
        prompt, text = body.prompt, ""
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise InvalidArgument("prompt", f"give one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = self.gateway.encode_text(prompt), prompt
        else:
            ids = [int(t) for t in prompt]
        return self.gateway.make_request(ids, params, max_tree_nodes=body.max_tree_nodes, text=text,
                                        speculation=body.speculation)
