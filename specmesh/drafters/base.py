"""The drafter interface: propose a token tree for a request, hear what was committed, forget it.

A drafter keeps per-request state (a KV cache, an n-gram index) keyed by request id. Its view of a
request is the committed token sequence; the last committed token is the tree's root, so proposed
nodes continue after it. "Nothing to say" is the empty tree, never None.

A proposal may *assume* tokens past the committed ones (drafting ahead while a verification is in
flight): the tree then continues after the assumed tokens, which are not committed; the next
proposal or commit starts again from the committed tokens.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from specmesh.errors import InvalidArgument
from specmesh.runtime.features import Features
from specmesh.tree import TokenTree


@runtime_checkable
class Drafter(Protocol):
    name: str
    kind: str  # "ngram", "history" (model-free: no model, next to no cost), "expert", "feature", "model"
    domains: tuple[str, ...]  # the request kinds it is an expert in (empty: none in particular)
    feature_layers: tuple[int, ...]  # the target layers whose hidden states it reads (empty: none)

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        """Begin a request whose committed tokens so far are ``prompt_ids``."""

    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        """Up to ``budget`` nodes continuing the committed tokens (followed by ``assumed``)."""

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """The target committed these tokens after the previous ones."""

    def add_features(self, request_id: str, features: Features) -> None:
        """The target's hidden states of ``feature_layers`` at committed positions (feature drafters)."""

    def end(self, request_id: str) -> None:
        """Free everything held for the request (unknown ids are ignored)."""


class DrafterBase:
    """What a drafter is unless it says otherwise: a drafter class subclasses it and sets what differs."""

    name: str
    kind = "model"
    domains: tuple[str, ...] = ()
    feature_layers: tuple[int, ...] = ()

    def add_features(self, request_id: str, features: Features) -> None:
        raise InvalidArgument("features", f"drafter {self.name!r} reads no features; send none")
