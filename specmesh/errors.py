"""Errors the domain code raises; the services map each one to a gRPC status in one place."""

from __future__ import annotations


class SpecmeshError(Exception):
    """Base of every error specmesh raises on purpose."""


class InvalidArgument(SpecmeshError, ValueError):
    """A caller's argument is wrong. ``field`` names it, the message says what is wrong and what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ResourceExhausted(SpecmeshError):
    """A limit (concurrent requests, cache capacity, queue length) is reached; retry later."""


class Unauthenticated(SpecmeshError):
    """The caller gave no valid credentials (an API key)."""


class Unavailable(SpecmeshError):
    """A dependency (Redis, every verifier, a drafter) cannot be reached in time; retry later."""


class RequestFailed(SpecmeshError):
    """One request's own numbers failed in a pass (the target's logits for it are not finite): that request
    ends with this error, the others in the pass go on."""


class NotFound(SpecmeshError, KeyError):
    """A named thing (a drafter session, a request) is not known here."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
