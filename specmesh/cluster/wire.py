"""Conversions between domain objects and their ``specmesh.v1`` protobuf messages."""

from __future__ import annotations

import torch

from specmesh.errors import InvalidArgument
from specmesh.runtime.features import Features
from specmesh.sampling import SamplingParams
from specmesh.speculation.requests import SpeculationStats, StepTiming
from specmesh.tree import TokenTree
from specmesh.v1 import common_pb2, router_pb2


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


def stats_to_pb(s: SpeculationStats) -> router_pb2.SpeculationStats:
    return router_pb2.SpeculationStats(
        target_steps=s.target_steps, drafted_nodes=s.drafted_nodes, accepted_tokens=s.accepted_tokens,
        mean_accepted_length=s.mean_accepted_length, resyncs=s.resyncs, first_token_ms=s.first_token_s * 1e3,
        total_ms=s.total_s * 1e3, drafters=sorted(s.drafter_steps), drafted_ahead=s.drafted_ahead,
        draft_ms=s.draft_s * 1e3, verify_ms=s.verify_s * 1e3, verifier_ms=s.verifier_s * 1e3,
        request_kind=s.request_kind, drafter_steps=s.drafter_steps,
    )


def trace_to_pb(timing: StepTiming) -> router_pb2.StepTrace:
    return router_pb2.StepTrace(budget=timing.budget, tree_nodes=timing.tree_nodes, draft_ms=timing.draft_ms,
                                pass_ms=timing.pass_ms, step_ms=timing.step_ms, batch_size=timing.batch_size)


def trace_from_pb(message: router_pb2.StepTrace) -> StepTiming:
    return StepTiming(message.budget, message.tree_nodes, message.draft_ms, message.pass_ms, message.step_ms,
                      message.batch_size)


def stats_from_pb(message: router_pb2.SpeculationStats) -> SpeculationStats:
    return SpeculationStats(
        target_steps=message.target_steps, drafted_nodes=message.drafted_nodes,
        accepted_tokens=message.accepted_tokens, committed_tokens=round(message.mean_accepted_length * message.target_steps),
        resyncs=message.resyncs, first_token_s=message.first_token_ms / 1e3, total_s=message.total_ms / 1e3,
        draft_s=message.draft_ms / 1e3, drafted_ahead=message.drafted_ahead, verify_s=message.verify_ms / 1e3,
        verifier_s=message.verifier_ms / 1e3, request_kind=message.request_kind, drafter_steps=dict(message.drafter_steps),
    )


FEATURE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_FEATURE_POSITIONS = 1 << 16  # a block larger than this is no step's or prompt tail's


def features_to_pb(features: Features) -> common_pb2.Features:
    """Features in fp16 (bf16 stays bf16: its range is the point of it), raw little-endian bytes."""
    values = features.values if features.values.dtype == torch.bfloat16 else features.values.to(torch.float16)
    values = values.detach().cpu().contiguous()
    return common_pb2.Features(
        start=features.start, positions=values.shape[0], layers=features.layers, hidden_size=values.shape[2],
        dtype=str(values.dtype).removeprefix("torch."), data=values.view(torch.uint8).numpy().tobytes(),
    )


def features_from_pb(message: common_pb2.Features) -> Features:
    """The block a message carries, checked: a malformed one is INVALID_ARGUMENT, never a crash."""
    dtype = FEATURE_DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidArgument("features", f"dtype {message.dtype!r} is not one of {', '.join(FEATURE_DTYPES)}")
    layers = tuple(message.layers)
    if not layers or message.hidden_size <= 0 or message.start < 0 or not 0 <= message.positions <= MAX_FEATURE_POSITIONS:
        raise InvalidArgument("features", f"need layers, hidden_size > 0, start >= 0 and 0..{MAX_FEATURE_POSITIONS} "
                              f"positions; got {len(layers)} layers, hidden_size {message.hidden_size}, start "
                              f"{message.start}, {message.positions} positions")
    expected = message.positions * len(layers) * message.hidden_size * dtype.itemsize
    if len(message.data) != expected:
        raise InvalidArgument("features", f"{message.positions} x {len(layers)} x {message.hidden_size} {message.dtype} "
                              f"values are {expected} bytes; got {len(message.data)}")
    values = torch.frombuffer(bytearray(message.data), dtype=dtype) if expected else torch.empty(0, dtype=dtype)
    return Features(message.start, values.view(message.positions, len(layers), message.hidden_size), layers)
