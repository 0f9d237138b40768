"""What the repository may hold: no file over 1 MB outside the shipped experts' weights (model weights
are artefacts that change only with a benchmark that shows them better, see docs/experts.md; anything
else that large is a data dump or a build product that every clone would carry forever)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 1 << 20
WEIGHTS = "specmesh/experts/"


def committed_sizes() -> dict[str, int]:
    """Path -> size in bytes of every file in HEAD's tree."""
    listing = subprocess.run(["git", "ls-tree", "-r", "-l", "-z", "HEAD"], cwd=ROOT, capture_output=True, check=True)
    sizes = {}
    for entry in listing.stdout.decode().split("\0"):
        if entry:
            meta, path = entry.split("\t", 1)
            size = meta.split()[3]
            if size != "-":  # a submodule
                sizes[path] = int(size)
    return sizes


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_committed_file_over_1_mb_outside_the_shipped_experts():
    sizes = committed_sizes()
    assert any(p.startswith(WEIGHTS) for p in sizes)  # the listing reaches the weights, so it sees sizes at all
    large = {p: s for p, s in sizes.items() if s > LIMIT_BYTES and not p.startswith(WEIGHTS)}
    assert not large, f"files over 1 MB outside {WEIGHTS}: {large}"
