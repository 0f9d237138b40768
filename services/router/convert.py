"""The router's replies in their ``specmesh.v1`` messages: usage, speculation statistics, step traces."""

from __future__ import annotations

from specmesh.cluster.gateway import Generation
from specmesh.speculation.policy import StepOutcome
from specmesh.v1 import router_pb2


def usage_pb(generation: Generation) -> router_pb2.Usage:
    return router_pb2.Usage(prompt_tokens=generation.prompt_tokens, completion_tokens=len(generation.token_ids))


def stats_pb(generation: Generation) -> router_pb2.SpeculationStats:
    s = generation.stats
    return router_pb2.SpeculationStats(
        target_steps=s.target_steps, drafted_nodes=s.drafted_nodes, accepted_tokens=s.accepted_tokens,
        mean_accepted_length=s.mean_accepted_length, resyncs=s.resyncs, first_token_ms=s.first_token_s * 1e3,
        total_ms=s.total_s * 1e3, drafters=generation.drafters, drafted_ahead=s.drafted_ahead,
        draft_ms=s.draft_s * 1e3, verify_ms=s.verify_s * 1e3, verifier_ms=s.verifier_s * 1e3, request_kind=s.request_kind, drafter_steps=s.drafter_steps,
    )


def trace_pb(outcome: StepOutcome) -> router_pb2.StepTrace:
    return router_pb2.StepTrace(budget=outcome.plan.budget, tree_nodes=len(outcome.fused), draft_ms=outcome.draft_ms,
                                pass_ms=outcome.pass_ms, step_ms=outcome.step_ms, batch_size=outcome.batch_size)


SPECULATION = {router_pb2.SPECULATION_UNSPECIFIED: None, router_pb2.SPECULATION_ADAPTIVE: "adaptive",
               router_pb2.SPECULATION_FIXED: "fixed", router_pb2.SPECULATION_OFF: "off"}
