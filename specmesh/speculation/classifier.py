"""The request kind: a cheap classifier of the prompt's text, the router's first guess at which
experts fit a request (what they then get accepted refines it, see ``expertise.py``).

A multinomial naive Bayes over lower-cased words and word pairs, trained in well under a second on
labelled example prompts — by default the templated training prompts of the expert domains
(``specmesh.distill.templates``; never the benchmark's questions). A prompt whose best kind is not
clearly ahead is ``general``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from specmesh.speculation.expertise import GENERAL

_WORD = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


def features(text: str) -> list[str]:
    """Words (runs of letters, of digits, single symbols) and adjacent word pairs."""
    words = ["#" if w.isdigit() else w for w in _WORD.findall(text.lower())]
    return words + [f"{a} {b}" for a, b in zip(words, words[1:])]


class RequestClassifier:
    def __init__(self, examples: Iterable[tuple[str, str]], smoothing: float = 0.5, min_margin: float = 2.0) -> None:
        """``examples``: (text, kind) pairs. ``min_margin``: log-odds by which the best kind must beat
        the runner-up, else the request is ``general``."""
        counts: dict[str, Counter] = defaultdict(Counter)
        docs: Counter = Counter()
        for text, kind in examples:
            counts[kind].update(features(text))
            docs[kind] += 1
        if not docs:
            raise ValueError("a classifier needs at least one labelled example")
        self.kinds = sorted(docs)
        self.min_margin = min_margin
        vocabulary = {f for c in counts.values() for f in c}
        total_docs = sum(docs.values())
        self._log_prior = {k: math.log(docs[k] / total_docs) for k in self.kinds}
        self._log_like: dict[str, dict[str, float]] = {}
        self._log_unseen: dict[str, float] = {}
        for kind in self.kinds:
            denominator = sum(counts[kind].values()) + smoothing * (len(vocabulary) + 1)
            self._log_like[kind] = {f: math.log((n + smoothing) / denominator) for f, n in counts[kind].items()}
            self._log_unseen[kind] = math.log(smoothing / denominator)
        self._vocabulary = vocabulary

    def scores(self, text: str) -> dict[str, float]:
        """Log-probability (unnormalised) of each kind; features never seen in training are ignored."""
        seen = [f for f in features(text) if f in self._vocabulary]
        return {k: self._log_prior[k] + sum(self._log_like[k].get(f, self._log_unseen[k]) for f in seen) for k in self.kinds}

    def classify(self, text: str) -> str:
        scores = sorted(self.scores(text).items(), key=lambda kv: -kv[1])
        if len(scores) == 1:
            return scores[0][0]
        (best, top), (_, second) = scores[0], scores[1]
        return best if top - second >= self.min_margin else GENERAL


EXAMPLES = Path(__file__).with_name("request_kinds.jsonl")


def default_classifier(domains: Sequence[str] | None = None) -> RequestClassifier:
    """Trained on the shipped example requests of the expert domains (all of them, or ``domains``)."""
    examples = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines()]
    kinds = {e["kind"] for e in examples}
    chosen = {d for d in (domains or ()) if d in kinds} or kinds
    return RequestClassifier((e["text"], e["kind"]) for e in examples if e["kind"] in chosen)
