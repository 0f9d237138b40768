"""The wire schema: generated code is current, and domain objects survive a round trip."""

import subprocess
import sys
from pathlib import Path

import pytest

from specmesh.cluster.wire import sampling_from_pb, sampling_to_pb, tree_from_pb, tree_to_pb
from specmesh.errors import InvalidArgument
from specmesh.sampling import SamplingParams
from specmesh.tree import ROOT, TokenTree
from specmesh.v1 import common_pb2

ROOT_DIR = Path(__file__).resolve().parents[1]


def test_generated_code_is_current(tmp_path):
    protos = sorted(str(p.relative_to(ROOT_DIR / "protos")) for p in (ROOT_DIR / "protos").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", *protos],
        cwd=ROOT_DIR, check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    for relative in generated:
        committed = ROOT_DIR / relative
        assert committed.exists(), f"{relative} is not committed: run make proto"
        assert committed.read_text() == (tmp_path / relative).read_text(), f"{relative} is stale: run make proto"


def test_tree_round_trip():
    tree = TokenTree((5, 6, 7), (ROOT, 0, ROOT), (0.5, 0.25, 0.125))
    assert tree_from_pb(common_pb2.TokenTree.FromString(tree_to_pb(tree).SerializeToString())) == tree


def test_malformed_tree_is_an_invalid_argument():
    with pytest.raises(InvalidArgument) as err:
        tree_from_pb(common_pb2.TokenTree(tokens=[1, 2], parents=[1, -1], draft_probs=[1, 1]))
    assert err.value.field == "tree"


def test_sampling_round_trip_and_defaults():
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.75, seed=9, max_tokens=12)
    assert sampling_from_pb(sampling_to_pb(params)) == params
    unseeded = sampling_from_pb(common_pb2.SamplingParams(max_tokens=4))
    assert unseeded.seed is None and unseeded.top_p == 1.0 and unseeded.greedy


def test_a_heartbeat_carries_the_pass_curve_and_anything_unsound_is_ignored():
    from specmesh.cluster.pipeline.messages import decode_pass_curve, encode_pass_curve
    from specmesh.runtime.calibration import PassCurve, PassSample

    curve = PassCurve("cuda", (PassSample(1, 0, 1, 7.3), PassSample(16, 16, 272, 17.6)))
    assert decode_pass_curve(encode_pass_curve(curve)) == curve
    assert decode_pass_curve(b"1") is None and decode_pass_curve(None) is None  # a bare heartbeat
    for forged in (b"{not json", b'{"device": "cpu"}', b'{"device": "cpu", "passes": [[1, 0, 1, -5.0]]}',
                   b'{"device": "cpu", "passes": [[4, 9, 2, 5.0]]}', b'{"device": "cpu", "passes": []}',
                   b'{"device": "cpu", "passes": [[1, 0, 1, "NaN"]]}', b"[1, 2]"):
        assert decode_pass_curve(forged) is None, forged
