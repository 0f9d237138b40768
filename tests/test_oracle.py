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
import torch

from specmesh.cli import main
from specmesh.drafters.catalog import load_drafter
from specmesh.drafters.oracle import OracleDrafter, OracleEntry, read_oracle_file, write_oracle_file
from specmesh.errors import InvalidArgument
from specmesh.speculation.expertise import level_hits
from specmesh.runtime.loading import load_target_parts
from specmesh.runtime.random_models import random_model
from specmesh.tree import TokenTree

VOCAB = 1000


def _oracle(tmp_path, acceptance, length=400, seed=0, width=1):
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(VOCAB) for _ in range(40))
    continuation = tuple(rng.randrange(VOCAB) for _ in range(length))
    path = write_oracle_file(tmp_path / "oracle.jsonl", [OracleEntry(prompt, continuation, acceptance, width=width)])
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


def _path_confidences(tree):
    along = []
    for parent, p in zip(tree.parents, tree.draft_probs):
        along.append(p * (along[parent] if parent >= 0 else 1.0))
    return along


def test_a_wide_oracle_ranks_the_right_token_as_its_confidences_say(tmp_path):
    p, width = 0.6, 3
    drafter, prompt, continuation = _oracle(tmp_path, p, length=3000, width=width)
    drafter.start("r", prompt)
    ranks = [0] * (width + 1)  # 0: not among the guesses
    for at in range(len(continuation) - 1):
        tree = drafter.propose("r", 32)
        first = [(t, q) for t, q, parent in zip(tree.tokens, tree.draft_probs, tree.parents) if parent == -1]
        guesses = [t for t, _ in first]  # the root's guesses, best first
        assert len(set(guesses)) == width
        assert [q for _, q in first] == pytest.approx([p * (1 - p) ** r for r in range(width)])
        ranks[guesses.index(continuation[at]) + 1 if continuation[at] in guesses else 0] += 1
        drafter.commit("r", continuation[at : at + 1])
    seen = [r / sum(ranks) for r in ranks]
    for rank in range(1, width + 1):
        assert abs(seen[rank] - p * (1 - p) ** (rank - 1)) < 0.03, seen
    assert abs(seen[0] - (1 - p) ** width) < 0.03, seen


def test_a_wide_oracle_grows_the_most_likely_tree_and_keeps_what_it_predicts(tmp_path):
    p = 0.8
    drafter, prompt, continuation = _oracle(tmp_path, p, length=4000, width=4)
    drafter.start("r", prompt)
    # best first: a chain while p^depth beats a runner-up's p (1 - p), then branches
    assert drafter.propose("r", 8).parents == tuple(range(-1, 7))
    big = drafter.propose("r", 256)
    assert drafter.propose("r", 40) == TokenTree(big.tokens[:40], big.parents[:40], big.draft_probs[:40])
    assert max(big.depths()) < 256 and len(big) == 256 and len(set(big.children()[0])) > 1
    along = _path_confidences(big)
    assert all(a >= b * (1 - 1e-9) for a, b in zip(along, along[1:]))  # most likely first
    predicted, kept, steps, at = 1 + sum(along), 0, 0, 0
    while at < len(continuation) - 300:
        hits, _ = level_hits(drafter.propose("r", 256), continuation[at:])
        step = continuation[at : at + hits + 1]  # the accepted path, then the target's own token
        drafter.commit("r", step)
        at, kept, steps = at + len(step), kept + len(step), steps + 1
    assert kept / steps > 1 / (1 - p)  # more than any chain at this acceptance can keep
    assert abs(kept / steps - predicted) < 0.1 * predicted, (kept / steps, predicted)


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
    path.write_text(json.dumps({"prompt_ids": [1, 2], "continuation": [3], "acceptance": 0.5, "width": 0}) + "\n")
    with pytest.raises(InvalidArgument, match="width"):
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
                 "--max-tokens", "16", "--sweep-rounds", "1", "--fixed-tree-nodes", "4",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["answers_unlike_plain"] == 0
    for row in report["acceptance"]["0.9"]["load_sweep"]:  # where the time went, measured
        assert row["redis_commands_per_token"] > 0 and row["router_cpu_ms_per_token"] > 0, row
        assert 0 < row["requests_per_pass"] <= row["concurrency"] and row["pass_gap_ms"] >= 0, row
        assert row["pass_ms"] > 0, row
    part = report["acceptance"]["0.9"]
    rows = {(r["concurrency"], r["policy"]): r for r in part["load_sweep"]}
    assert set(rows) == {(c, p) for c in (1, 2) for p in ("none", "fixed", "adaptive")}
    assert all(r["tokens_per_step"] == 1.0 for k, r in rows.items() if k[1] == "none")
    # a chain of 4 right with p = 0.9 each: 1 + 0.9 + ... + 0.9^4 = 4.1 tokens a step expected
    assert rows[(1, "fixed")]["tokens_per_step"] > 2.5
    steps = part["timeline"]["steps"]
    assert sum(s["tokens"] for s in steps) == 16
    assert all(s["step_ms"] > 0 and s["tree_nodes"] <= s["budget"] <= 16 for s in steps)
    # plain at each load beside the same stepper in process, on the same requests
    for level, row in report["cluster_at_load"].items():
        assert row["cluster_tokens_per_s"] == rows[(int(level), "none")]["tokens_per_s"], row
        assert row["engine_tokens_per_s"] > 0 and row["verifier_capacity_tokens_per_s"] > 0, row
        assert row["pass_ms"] > 0 and row["engine_pass_ms"] > 0, row
        assert 0 < row["in_flight"] <= int(level) and row["cluster_vs_engine"] > 0, row
    assert set(report["cluster_at_load"]) == {"1", "2"}


@pytest.mark.slow
def test_a_wide_oracle_through_an_offloaded_cluster_keeps_more_than_any_chain_could(tmp_path):
    out = tmp_path / "oracle.json"
    code = main(["bench", "--model", "random:tiny", "--offload", "--oracle-acceptance", "0.6", "--oracle-width", "4",
                 "--concurrency", "1", "--max-tokens", "48", "--sweep-rounds", "1", "--fixed-tree-nodes", "32",
                 "--max-tree-nodes", "64", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["answers_unlike_plain"] == 0 and report["offload"] and report["oracle_width"] == 4
    assert report["cluster_at_load"] == {}  # no second offloaded target in process: its passes would double
    # the verifier streamed: every pass copied every decoder layer from host memory (2 bytes a weight at least)
    layers = random_model("random:tiny", torch.float32, torch.device("cpu")).model.layers
    weights = sum(p.numel() for p in layers.parameters())
    assert report["streamed"] and all(v["passes"] > 0 and v["bytes"] >= v["passes"] * 2 * weights
                                      for v in report["streamed"].values()), report["streamed"]
    rows = {r["policy"]: r for r in report["acceptance"]["0.6"]["load_sweep"]}
    # 32-node trees grown best-first commit ~4.1 tokens a step at p = 0.6; a chain, at most 1 / (1 - p) = 2.5
    assert rows["fixed"]["tokens_per_step"] > 2.5
