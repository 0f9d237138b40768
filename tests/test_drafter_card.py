"""`specmesh drafters check`: a card per drafter against the embedded target — fits or refused with the
reason, the cost of a drafted token against the target's step, teacher-forced agreement on a prompt file."""

from __future__ import annotations

import json
import random

import pytest
from test_eagle import write_head

from specmesh.cli import main


@pytest.mark.slow
def test_each_drafter_gets_a_card_and_a_misfit_its_reason(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in [
        {"prompt": "Write a short poem about the sea, then repeat its first line.", "category": "writing"},
        {"prompt": "List the numbers from 1 to 12, separated by commas.", "category": "math"}]))
    head = write_head(tmp_path / "eagle3", hidden=576, heads=9, kv=3, inter=1536, vocab=49152,
                      draft_ids=sorted(random.Random(1).sample(range(49152), 2000)))
    misfit = write_head(tmp_path / "misfit", hidden=64, vocab=96)  # made for another (tiny) target
    out = tmp_path / "cards.json"
    code = main(["drafters", "check", "--drafter", "ngram", "--drafter", head, "--drafter", misfit,
                 "--prompts", str(prompts), "--max-tokens", "24", "--json", str(out)])
    assert code == 1  # one drafter does not fit
    report = json.loads(out.read_text())
    assert report["target_step_ms"] > 0 and report["provenance"]["command"].startswith("specmesh drafters check")
    ngram, eagle3, refused = report["drafters"]
    for card in (ngram, eagle3):
        assert card["compatible"] and set(card["agreement"]) >= {"writing", "math", "all"}
        assert 0 <= card["agreement"]["all"] <= 1 and card["ms_per_drafted_token"] > 0
        assert card["cost_vs_target_step"] == pytest.approx(card["ms_per_drafted_token"] / report["target_step_ms"],
                                                            rel=1e-2, abs=1e-3)
        assert float(card["expected_tokens_per_step"]["4"]) >= 1.0
    assert ngram["agreement"]["all"] > 0  # the answer repeats the prompt's words: prompt lookup finds some
    assert eagle3["kind"] == "feature" and eagle3["feature_layers"] == [2, 15, 27]
    assert not refused["compatible"] and "reads hidden states of size 64" in refused["reason"]
