"""Where a measurement comes from: the command that made it, the commit it ran at, when; written into
every benchmark's JSON so that each figure quoted from it can be reproduced."""

from __future__ import annotations

import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from specmesh import __version__

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The checkout's commit, "+changes" when its tracked files differ from it; the package version outside
    a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return f"specmesh {__version__} (not a git checkout)"


def provenance(argv: Sequence[str], program: str = "specmesh") -> dict:
    return {"command": " ".join([program, shlex.join(argv)]).strip(), "commit": commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
