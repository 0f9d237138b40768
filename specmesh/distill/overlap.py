"""Training prompts never overlap the benchmark.

A text overlaps MT-Bench when it shares a run of ``SHINGLE`` words with any turn of its 80 questions (the
first turns the benchmark asks, and the follow-ups, which are its questions too), comparing words as
lower-case runs of letters and digits, so case, punctuation and spacing make no difference; or when it is,
word for word, a turn too short to hold such a run. Every prompt ``distill`` makes passes through here:
templated ones are drawn again, target-written ones dropped; and whatever prompts ``distill`` and
``distill_feature`` are given, from any source, are filtered again on entry (``without_benchmark``).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, mtbench_questions

log = logging.getLogger("specmesh.distill")

SHINGLE = 8  # words: sharing a run this long with a benchmark question is overlapping it

_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """The text's words: lower-case runs of letters and digits."""
    return _WORD.findall(text.lower())


def key(text: str) -> str:
    """A text's identity up to case, punctuation and spacing."""
    return " ".join(words(text))


def shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive words of the text."""
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


@dataclass(frozen=True)
class Benchmark:
    """Texts that nothing trained on may overlap, each under an id (MT-Bench's question id)."""

    runs: dict[tuple[str, ...], frozenset[int]]  # every SHINGLE-word run -> the ids of the texts holding it
    short: dict[str, frozenset[int]]  # texts with fewer than SHINGLE words, by key -> their ids

    @classmethod
    def of(cls, texts: Iterable[tuple[int, str]]) -> Benchmark:
        runs: dict[tuple[str, ...], set[int]] = {}
        short: dict[str, set[int]] = {}
        for ident, text in texts:
            if len(words(text)) < SHINGLE:
                short.setdefault(key(text), set()).add(ident)
            for run in shingles(text):
                runs.setdefault(run, set()).add(ident)
        short.pop("", None)
        return cls({r: frozenset(i) for r, i in runs.items()}, {k: frozenset(i) for k, i in short.items()})

    def matches(self, text: str) -> list[int]:
        """The ids of the texts that ``text`` overlaps, in order."""
        found = set(self.short.get(key(text), ()))
        for run in shingles(text):
            found |= self.runs.get(run, frozenset())
        return sorted(found)

    def overlaps(self, text: str) -> bool:
        return key(text) in self.short or any(run in self.runs for run in shingles(text))


def mtbench_turns() -> list[tuple[int, str]]:
    """Every turn of MT-Bench's questions, first and follow-up, as (question id, text)."""
    return [(int(row["question_id"]), turn) for row in mtbench_questions() for turn in row["turns"]]


@functools.cache
def mtbench() -> Benchmark:
    return Benchmark.of(mtbench_turns())


def overlaps(text: str) -> bool:
    """Whether ``text`` overlaps an MT-Bench question (any turn): never train on it."""
    return mtbench().overlaps(text)


def overlapped_questions(text: str) -> list[int]:
    """The ids of the MT-Bench questions ``text`` overlaps."""
    return mtbench().matches(text)


def without_benchmark(prompts: Sequence[Prompt]) -> list[Prompt]:
    """The training prompts less those that overlap an MT-Bench question (said in the log); none left is
    an ``InvalidArgument``."""
    kept = [p for p in prompts if not overlaps(p.text)]
    if not kept:
        raise InvalidArgument("prompts", f"every one of the {len(prompts)} prompts overlaps an MT-Bench question, the "
                                         f"benchmark: nothing is left to train on")
    if len(kept) < len(prompts):
        log.warning("%d of %d prompts overlap an MT-Bench question and are left out", len(prompts) - len(kept), len(prompts))
    return kept
