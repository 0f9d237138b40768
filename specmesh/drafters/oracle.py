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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specmesh.drafters.base import DrafterBase
from specmesh.errors import InvalidArgument
from specmesh.tree import TokenTree

PREFIX = "oracle:"
KEY_TOKENS = 32  # prompts are told apart by their first tokens, so a resync's longer history still matches


@dataclass(frozen=True)
class OracleEntry:
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]  # the target's greedy tokens after the prompt
    acceptance: float  # p: each proposed token is the target's with this probability
    seed: int = 0


def write_oracle_file(path: str | Path, entries: Sequence[OracleEntry]) -> Path:
    """One JSON line per prompt (the format ``OracleDrafter`` reads)."""
    path = Path(path)
    with path.open("w") as out:
        for e in entries:
            out.write(json.dumps({"prompt_ids": list(e.prompt), "continuation": list(e.continuation),
                                  "acceptance": e.acceptance, "seed": e.seed}) + "\n")
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
                                float(row["acceptance"]), int(row.get("seed", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument("drafter", f"{path}:{number}: not an oracle entry ({exc})") from None
        if not 0.0 <= entry.acceptance <= 1.0 or not entry.prompt:
            raise InvalidArgument("drafter", f"{path}:{number}: needs a prompt and 0 <= acceptance <= 1")
        entries.append(entry)
    return entries


def position_draw(entry: OracleEntry, index: int) -> tuple[float, int]:
    """(u in [0, 1), an integer) for continuation position ``index``: the same in every process and step."""
    digest = hashlib.blake2b(f"{entry.seed}:{entry.prompt[:KEY_TOKENS]}:{index}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little") / 2**64, int.from_bytes(digest[8:], "little")


@dataclass
class _State:
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
        self._states: dict[str, _State] = {}
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
        self._states[request_id] = _State(self._lookup(prompt_ids), [int(t) for t in prompt_ids])

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
        tokens = []
        for index in range(at, min(at + budget, len(entry.continuation))):
            u, pick = position_draw(entry, index)
            right = entry.continuation[index]
            tokens.append(right if u < entry.acceptance else (right + 1 + pick % (self.vocab_size - 1)) % self.vocab_size)
        return TokenTree.chain(tokens, [entry.acceptance] * len(tokens))
