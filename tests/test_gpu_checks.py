"""`make gpu-check` rehearsed on this CPU (`REHEARSE=1`: random:tiny, few repeats): every check of the long
profile but CUDA's own (the tile ladder, the kernel tests) runs with the arguments the GPU window gives it and
writes its figures, so a check broken here never costs a window (one did: the first figure's bench crashed
whenever it ran without --offload)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_long_profile_runs_every_check_and_writes_its_figures(tmp_path):
    env = {**os.environ, "REHEARSE": "1", "PROFILE": "long", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(["bash", "tests/gpu_checks.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "gpu-check passed" in result.stdout
    step = json.loads((tmp_path / "tiny.json").read_text())
    assert step["lossless"]["identical"] and step["step_vs_limit"] > 0 and step["tree16_vs_step"] > 0
    rows = step["batch_invariance"]
    assert rows["bitwise_equal"] == rows["rows"] > 0
    offloaded = json.loads((tmp_path / "offload-tiny.json").read_text())
    assert offloaded["offload"] and offloaded["tree1024_vs_step"] > 0
    for name in ("oracle-tiny.json", "offload-oracle-tiny.json"):
        cluster = json.loads((tmp_path / name).read_text())
        assert cluster["answers_unlike_plain"] == 0, name
    assert "2 passed" in (tmp_path / "tp.txt").read_text()
    head = json.loads((tmp_path / "head-cost-smollm2-135m.json").read_text())
    assert all(head["greedy_equal"]) and head["proposals"]
