"""Templated training prompts: reproducible, distinct, and a domain's added stream leaves its first alone."""

import json
import random

from specmesh.distill import templates
from specmesh.distill.templates import domain_prompts
from specmesh.speculation.classifier import EXAMPLES


def test_prompts_are_distinct_and_the_same_for_the_same_seed():
    for domain in templates.DOMAINS:
        first = [p.text for p in domain_prompts(domain, 300)]
        assert len(set(first)) == 300
        assert first == [p.text for p in domain_prompts(domain, 300)]
        assert first != [p.text for p in domain_prompts(domain, 300, seed=1)]


def test_an_added_stream_takes_its_share_and_leaves_the_first_streams_prompts_as_they_were(monkeypatch):
    mixed = [p.text for p in domain_prompts("writing", 1000)]
    ((_, share),) = templates._MORE_STREAMS["writing"]
    monkeypatch.setattr(templates, "_MORE_STREAMS", {})
    alone = [p.text for p in domain_prompts("writing", 1000)]
    alone_set = set(alone)
    from_first = [text for text in mixed if text in alone_set]
    assert from_first == alone[: len(from_first)]  # the same prompts, in the same order: their answers stay cached
    assert len(from_first) == round(1000 * (1 - share))  # the rest are the craft stream's


def test_texts_to_edit_differ_from_their_correct_version_only_in_a_few_words():
    rng = random.Random(7)
    for _ in range(50):
        wrong, correct = templates._edit_text(rng)
        changed = [(w, c) for w, c in zip(wrong.split(" "), correct.split(" ")) if w != c]
        assert len(wrong.split(" ")) == len(correct.split(" "))
        assert 1 <= len(changed) <= 5
        assert all(templates._ROUGHEN[c] == w for w, c in changed)


def test_the_classifiers_shipped_examples_are_the_templates_output():
    # `make classifier-data` writes them; the running router reads the file, not the templates
    shipped = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines()]
    assert shipped == templates.classifier_examples()
