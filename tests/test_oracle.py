"""The bench's oracle drafter and the cluster bench it drives, on CPU.

The drafter: each proposed token is the target's with probability p, decided per position so that
every process and step agree; it guesses nothing for an unknown prompt or once a request leaves the
known continuation; the catalog gives it to random-weights targets only. The bench: random-weights
targets run through the whole cluster (router, Redis, verifier, the oracle's drafter service), every
speculative answer equals plain decoding through the same cluster, and the per-step timeline carries
the controller's budgets."""

import json
import random

import pytest

from specmesh.cli import main
from specmesh.drafters.catalog import load_drafter
from specmesh.drafters.oracle import OracleDrafter, OracleEntry, read_oracle_file, write_oracle_file
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import load_target_parts

VOCAB = 1000


def _oracle(tmp_path, acceptance, length=400, seed=0):
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(VOCAB) for _ in range(40))
    continuation = tuple(rng.randrange(VOCAB) for _ in range(length))
    path = write_oracle_file(tmp_path / "oracle.jsonl", [OracleEntry(prompt, continuation, acceptance)])
    return OracleDrafter(path, VOCAB), prompt, continuation


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 0.8, 1.0])
def test_each_token_is_right_with_the_set_probability(tmp_path, acceptance):
    drafter, prompt, continuation = _oracle(tmp_path, acceptance, length=2000)
    drafter.start("r", prompt)
    right = 0
    for at in range(0, len(continuation), 8):  # commit the true tokens, as the target would
        tree = drafter.propose("r", 8)
        assert tree.parents == tuple(range(-1, len(tree) - 1))  # a chain
        right += sum(t == c for t, c in zip(tree.tokens, continuation[at:]))
        assert all(0 <= t < VOCAB for t in tree.tokens)
        drafter.commit("r", continuation[at : at + 8])
    assert abs(right / len(continuation) - acceptance) < 0.035


def test_a_position_is_right_or_wrong_whichever_step_proposes_it(tmp_path):
    first, prompt, continuation = _oracle(tmp_path, 0.5)
    second = OracleDrafter(tmp_path / "oracle.jsonl", VOCAB)  # another process reading the same file
    first.start("a", prompt)
    second.start("b", prompt)
    second.commit("b", continuation[:3])
    long, late = first.propose("a", 10).tokens, second.propose("b", 7).tokens
    assert long[3:] == late
    assert first.propose("a", 10, assumed=continuation[:3]).tokens[:7] == late  # drafting ahead: the same fates


def test_no_guess_for_an_unknown_prompt_or_off_the_continuation(tmp_path):
    drafter, prompt, continuation = _oracle(tmp_path, 1.0)
    drafter.start("unknown", (1, 2, 3))
    assert len(drafter.propose("unknown", 8)) == 0
    drafter.start("off", prompt)
    drafter.commit("off", [(continuation[0] + 1) % VOCAB])  # a sampled token the oracle did not predict
    assert len(drafter.propose("off", 8)) == 0
    drafter.start("end", prompt)
    drafter.commit("end", continuation[:-2])
    assert drafter.propose("end", 8).tokens == continuation[-2:]  # nothing past what it knows
    drafter.end("end")
    drafter.end("never-started")


def test_prompts_written_later_are_read_on_first_use(tmp_path):
    path = tmp_path / "oracle.jsonl"
    drafter = OracleDrafter(path, VOCAB)  # not written yet: every prompt unknown
    drafter.start("early", tuple(range(40)))
    assert len(drafter.propose("early", 4)) == 0
    write_oracle_file(path, [OracleEntry(tuple(range(40)), (7, 8, 9), 1.0)])
    drafter.start("late", tuple(range(40)))
    assert drafter.propose("late", 4).tokens == (7, 8, 9)
    assert read_oracle_file(path)[0].continuation == (7, 8, 9)


def test_bad_oracle_files_are_refused_by_line(tmp_path):
    path = tmp_path / "oracle.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2], "continuation": [3], "acceptance": 1.5}) + "\n")
    with pytest.raises(InvalidArgument, match="oracle.jsonl:1"):
        read_oracle_file(path)
    path.write_text("{not json\n")
    with pytest.raises(InvalidArgument, match="not an oracle entry"):
        read_oracle_file(path)


def test_the_oracle_serves_random_weights_targets_only(tmp_path):
    path = write_oracle_file(tmp_path / "oracle.jsonl", [])
    random_target = load_target_parts("random:smollm2-135m")
    assert isinstance(load_drafter(f"oracle:{path}", random_target, None, None), OracleDrafter)
    with pytest.raises(InvalidArgument, match="random:<architecture> targets only"):
        load_drafter(f"oracle:{path}", load_target_parts("smollm2-135m-instruct"), None, None)


def test_random_targets_have_a_tokenizer_of_their_vocabulary():
    parts = load_target_parts("random:llama-3-8b")
    assert parts.vocab_size == 128256 and parts.eos_token_ids == (2,)
    assert parts.tokenizer("<5> <128255>")["input_ids"] == [5, 128255]
    assert parts.tokenizer.decode([5, 17]) == "<5> <17>"
    with pytest.raises(InvalidArgument, match="random weights"):
        parts.input_embeddings()


@pytest.mark.slow
def test_the_oracle_bench_runs_the_cluster_losslessly(tmp_path):
    out = tmp_path / "oracle.json"
    code = main(["bench", "--model", "random:tiny", "--oracle-acceptance", "0.9", "--concurrency", "1,2",
                 "--max-tokens", "16", "--sweep-rounds", "1", "--fixed-tree-nodes", "4", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["answers_unlike_plain"] == 0
    part = report["acceptance"]["0.9"]
    rows = {(r["concurrency"], r["policy"]): r for r in part["load_sweep"]}
    assert set(rows) == {(c, p) for c in (1, 2) for p in ("none", "fixed", "adaptive")}
    assert all(r["tokens_per_step"] == 1.0 for k, r in rows.items() if k[1] == "none")
    # a chain of 4 right with p = 0.9 each: 1 + 0.9 + ... + 0.9^4 = 4.1 tokens a step expected
    assert rows[(1, "fixed")]["tokens_per_step"] > 2.5
    steps = part["timeline"]["steps"]
    assert sum(s["tokens"] for s in steps) == 16
    assert all(s["step_ms"] > 0 and s["tree_nodes"] <= s["budget"] <= 16 for s in steps)
