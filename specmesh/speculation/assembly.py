"""Putting an engine together from model references: the target runtime plus the named drafters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specmesh.drafters.base import Drafter
from specmesh.drafters.catalog import load_drafter
from specmesh.prompts import encode_chat
from specmesh.runtime.calibration import PassCurve, measure_pass_curve
from specmesh.runtime.loading import LoadedModel, parts_of
from specmesh.runtime.target import TargetRuntime, load_target
from specmesh.sampling import SamplingParams
from specmesh.speculation.classifier import RequestClassifier
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.speculation.policy import SPECULATION_MARGIN, adaptive_policy, check_speculation


@dataclass
class Assembly:
    target: LoadedModel
    runtime: TargetRuntime
    drafters: list[Drafter]
    _pass_curve: PassCurve | None = field(default=None, repr=False)

    def engine(self, max_tree_nodes: int, speculation: str = "adaptive",
               margin: float = SPECULATION_MARGIN) -> SpeculativeEngine:
        """An engine over the target and the drafters. ``speculation``, as the router's: ``adaptive``
        (drafters routed by request kind, trust-weighted fusion, budget by goodput), ``fixed`` (routed,
        the whole budget every step) or ``off``."""
        if check_speculation(speculation) == "off":
            max_tree_nodes = 0
        policy = adaptive_policy({}, adapt_budget=speculation == "adaptive", margin=margin)
        if speculation == "adaptive" and max_tree_nodes > 0:
            policy.calibrate([self.pass_curve()])
        for drafter in self.drafters:
            policy.expertise.register(drafter)
        return SpeculativeEngine(
            self.runtime,
            drafters=self.drafters if max_tree_nodes > 0 else [],
            max_tree_nodes=max_tree_nodes,
            eos_token_ids=eos_token_ids(self.target),
            policy=policy,
        )

    def pass_curve(self) -> PassCurve:
        """The runtime's passes measured once (see ``runtime.calibration``): the adaptive policy's cost prior."""
        if self._pass_curve is None:
            self._pass_curve = measure_pass_curve(self.runtime)
        return self._pass_curve

    def request(self, prompt: str, params: SamplingParams, classifier: RequestClassifier | None = None) -> Request:
        """A single-turn chat request, its kind classified from the prompt's text when a classifier is given."""
        ids = tuple(encode_chat(self.target.tokenizer, prompt))
        return Request(ids, params, kind=classifier.classify(prompt) if classifier is not None else "")


def eos_token_ids(model: LoadedModel) -> list[int]:
    return list(parts_of(model).eos_token_ids)


def assemble(
    model: str, drafters: Sequence[str] = ("ngram",), device: str | None = None, dtype: str | None = None,
    precision: str = "shipped", kv_cache_gb: float | None = None, batch_invariant: bool | None = None,
    offload: bool = False,
) -> Assembly:
    """The target (in ``precision``: see ``runtime.target.PRECISIONS``; its KV cache within ``kv_cache_gb``;
    ``batch_invariant``: see ``PagedLlamaRuntime``; ``offload``: see ``load_target``) and the named drafters."""
    target, runtime = load_target(model, dtype, device, precision, kv_cache_gb, batch_invariant, offload)
    return Assembly(target, runtime, [load_drafter(d, target, device, dtype) for d in drafters])
