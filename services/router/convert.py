"""The router's replies in their ``specmesh.v1`` messages: usage and speculation statistics."""

from __future__ import annotations

from specmesh.cluster.gateway import RequestState
from specmesh.cluster.wire import stats_to_pb
from specmesh.v1 import router_pb2


def usage_pb(generation: RequestState) -> router_pb2.Usage:
    return router_pb2.Usage(prompt_tokens=generation.prompt_tokens, completion_tokens=len(generation.token_ids))


def stats_pb(generation: RequestState) -> router_pb2.SpeculationStats:
    return stats_to_pb(generation.stats)


SPECULATION = {router_pb2.SPECULATION_UNSPECIFIED: None, router_pb2.SPECULATION_ADAPTIVE: "adaptive",
               router_pb2.SPECULATION_FIXED: "fixed", router_pb2.SPECULATION_OFF: "off"}
