"""The bench's oracle drafter: the target's own greedy continuation, each token right with probability p.

Random weights give real drafters nothing to agree with, so nothing measures what speculation gives on
a device. This drafter sets the acceptance instead (``specmesh bench --model random:<arch>
--oracle-acceptance 0.8``): it knows the continuations of an oracle file that the bench writes from
plain decoding of the same prompts, and proposes them with errors. It is for measurement only: the
catalog gives it to random-weights targets alone.

A position's fate is fixed by (seed, prompt, position): whichever step proposes the token at position
i, it is the target's with probability p and another token otherwise, so a chain is accepted up to its
first wrong token and the accepted length does not depend on timing or batching. An unknown prompt, or
a request that left the known continuation, gets the empty tree (no guess).

With ``width`` w > 1 the oracle has w ranked guesses a position, like a drafter's top-w: the target's
token is its r-th guess with probability p (1 - p)^(r - 1) (its first with p, as in a chain), and none
of them with (1 - p)^w. Its confidence in a guess is that probability, so the confidences are
calibrated, and its trees are grown best-first by path confidence (SpecExec): the nodes most likely to
be accepted, however the budget splits between depth and width.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specmesh.drafters.base import DrafterBase
from specmesh.errors import InvalidArgument
from specmesh.tree import ROOT, TokenTree

PREFIX = "oracle:"
KEY_TOKENS = 32  # prompts are told apart by their first tokens, so a resync's longer history still matches
MAX_WIDTH = 64  # ranked guesses a position at most


@dataclass(frozen=True)
class OracleEntry:
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]  # the target's greedy tokens after the prompt
    acceptance: float  # p: each proposed token is the target's with this probability
    seed: int = 0
    width: int = 1  # ranked guesses a position (1: a chain)


def write_oracle_file(path: str | Path, entries: Sequence[OracleEntry]) -> Path:
    """One JSON line per prompt (the format ``OracleDrafter`` reads)."""
    path = Path(path)
    with path.open("w") as out:
        for e in entries:
            out.write(json.dumps({"prompt_ids": list(e.prompt), "continuation": list(e.continuation),
                                  "acceptance": e.acceptance, "seed": e.seed, "width": e.width}) + "\n")
    return path


def read_oracle_file(path: str | Path) -> list[OracleEntry]:
    entries = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidArgument("drafter", f"cannot read the oracle file {str(path)!r}: {exc.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            entry = OracleEntry(tuple(int(t) for t in row["prompt_ids"]), tuple(int(t) for t in row["continuation"]),
                                float(row["acceptance"]), int(row.get("seed", 0)), int(row.get("width", 1)))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument("drafter", f"{path}:{number}: not an oracle entry ({exc})") from None
        if not 0.0 <= entry.acceptance <= 1.0 or not entry.prompt or not 1 <= entry.width <= MAX_WIDTH:
            raise InvalidArgument("drafter", f"{path}:{number}: needs a prompt, 0 <= acceptance <= 1 and "
                                  f"1 <= width <= {MAX_WIDTH}")
        entries.append(entry)
    return entries


def position_draw(entry: OracleEntry, index: int) -> tuple[float, int]:
    """(u in [0, 1), an integer) for continuation position ``index``: the same in every process and step."""
    digest = hashlib.blake2b(f"{entry.seed}:{entry.prompt[:KEY_TOKENS]}:{index}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little") / 2**64, int.from_bytes(digest[8:], "little")


def truth_rank(u: float, acceptance: float, width: int) -> int | None:
    """The rank (1-based) of the target's token among ``width`` guesses for a position whose draw is
    ``u``: rank <= r when u < 1 - (1 - p)^r; None when it is not among them."""
    missed = 1.0
    for rank in range(1, width + 1):
        missed *= 1.0 - acceptance
        if u < 1.0 - missed:
            return rank
    return None


def ranked_guesses(entry: OracleEntry, index: int, vocab_size: int) -> list[int]:
    """The oracle's ``entry.width`` guesses for continuation position ``index``, best first: the target's
    token at its drawn rank, distinct wrong tokens elsewhere."""
    u, pick = position_draw(entry, index)
    right = entry.continuation[index]
    rank = truth_rank(u, entry.acceptance, entry.width)
    wrong = ((right + 1 + (pick + k) % (vocab_size - 1)) % vocab_size for k in range(entry.width))
    return [right if r == rank else next(wrong) for r in range(1, entry.width + 1)]


def best_first_tree(entry: OracleEntry, at: int, budget: int, vocab_size: int) -> TokenTree:
    """The ``budget`` nodes of highest path confidence below continuation position ``at`` (parents first)."""
    confidence = [entry.acceptance * (1.0 - entry.acceptance) ** r for r in range(entry.width)]  # by rank
    guesses: dict[int, list[int]] = {}  # position -> its ranked guesses (the same under every parent)
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    # (-path confidence, order, depth, parent node, the parent's path confidence, rank)
    frontier = [(-confidence[0], 0, 1, ROOT, 1.0, 0)]
    pushed = 1
    while frontier and len(tokens) < budget:
        negative, _, depth, parent, above, rank = heapq.heappop(frontier)
        index = at + depth - 1
        if index not in guesses:
            guesses[index] = ranked_guesses(entry, index, vocab_size)
        tokens.append(guesses[index][rank])
        parents.append(parent)
        probs.append(confidence[rank])
        if rank + 1 < entry.width:  # the next sibling, now that this one is in
            heapq.heappush(frontier, (-above * confidence[rank + 1], pushed, depth, parent, above, rank + 1))
            pushed += 1
        if index + 1 < len(entry.continuation):  # the first child
            heapq.heappush(frontier, (negative * confidence[0], pushed, depth + 1, len(tokens) - 1, -negative, 0))
            pushed += 1
    return TokenTree(tuple(tokens), tuple(parents), tuple(probs))


@dataclass
class _OracleState:
    entry: OracleEntry | None
    committed: list[int]


class OracleDrafter(DrafterBase):
    kind = "oracle"

    def __init__(self, path: str | Path, vocab_size: int, name: str = "oracle") -> None:
        self.name = name
        self.path = Path(path)
        self.vocab_size = vocab_size
        self._entries: dict[tuple[int, ...], OracleEntry] = {}
        self._read_at: float | None = None
        self._states: dict[str, _OracleState] = {}
        self._reload()

    def _reload(self) -> None:
        """Read the file again when it changed: the bench adds prompts once their plain run is done."""
        try:
            changed = self.path.stat().st_mtime_ns
        except OSError:
            return  # not written yet: every prompt is unknown
        if changed != self._read_at:
            self._entries = {e.prompt[:KEY_TOKENS]: e for e in read_oracle_file(self.path)}
            self._read_at = changed

    def _lookup(self, prompt_ids: Sequence[int]) -> OracleEntry | None:
        key = tuple(int(t) for t in prompt_ids[:KEY_TOKENS])
        entry = self._entries.get(key)
        if entry is None:
            self._reload()
            entry = self._entries.get(key)
        if entry is None or tuple(prompt_ids[: len(entry.prompt)]) != entry.prompt:
            return None
        return entry

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._states[request_id] = _OracleState(self._lookup(prompt_ids), [int(t) for t in prompt_ids])

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._states[request_id].committed.extend(int(t) for t in new_token_ids)

    def end(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        state = self._states[request_id]
        entry = state.entry
        if entry is None or budget <= 0:
            return TokenTree()
        history = [*state.committed, *(int(t) for t in assumed)]
        at = len(history) - len(entry.prompt)  # continuation position of the first proposed token
        if at < 0 or tuple(history[len(entry.prompt):]) != entry.continuation[:at]:
            return TokenTree()  # off the known continuation (sampling, or another max_tokens): no guess
        if at >= len(entry.continuation):
            return TokenTree()
        return best_first_tree(entry, at, budget, self.vocab_size)
