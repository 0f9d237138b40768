"""Conversions between domain objects and their ``specmesh.v1`` protobuf messages."""

from __future__ import annotations

from specmesh.errors import InvalidArgument
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from specmesh.v1 import common_pb2


def tree_to_pb(tree: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents, draft_probs=tree.draft_probs)


def tree_from_pb(message: common_pb2.TokenTree) -> TokenTree:
    try:
        return TokenTree(tuple(message.tokens), tuple(message.parents), tuple(message.draft_probs))
    except ValueError as exc:
        raise InvalidArgument("tree", str(exc)) from None


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, max_tokens=params.max_tokens
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def sampling_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p or 1.0,  # proto3's default 0 means "not set"
        seed=message.seed if message.HasField("seed") else None,
        max_tokens=message.max_tokens,
    )
