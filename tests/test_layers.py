"""The packages' import direction (pyproject's ``[tool.importlinter]`` contracts), checked by import-linter.

The design card's top-level ``services/`` and ``kernels/`` folders are the sub-packages
``specmesh.services`` and ``specmesh.kernels`` only once installed, and import-linter reads packages
from their folders; so the check runs on a copy of the sources laid out as installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"specmesh": "specmesh", "services": "specmesh/services", "kernels": "specmesh/kernels"}


def test_the_packages_import_only_downwards(tmp_path):
    for source, target in FOLDERS.items():
        for path in (ROOT / source).rglob("*.py"):
            copy = tmp_path / target / path.relative_to(ROOT / source)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache", str(ROOT / "pyproject.toml")], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout
