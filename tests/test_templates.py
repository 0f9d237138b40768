"""Templated training prompts: reproducible, distinct, and never overlapping MT-Bench."""

import json

from specmesh.bench.tune import TUNING_PROMPTS
from specmesh.distill import templates
from specmesh.distill.overlap import mtbench_turns, overlaps
from specmesh.distill.templates import CLASSIFIER_SEED, HELD_OUT_FROM, TUNING_SEED, domain_prompts
from specmesh.prompts import load_prompts
from specmesh.speculation.classifier import EXAMPLES


def test_prompts_are_distinct_and_the_same_for_the_same_seed():
    for domain in templates.DOMAINS:
        first = [p.text for p in domain_prompts(domain, 300)]
        assert len(set(first)) == 300
        assert first == [p.text for p in domain_prompts(domain, 300)]
        assert first != [p.text for p in domain_prompts(domain, 300, seed=1)]


def test_no_domains_prompts_overlap_mtbench():
    for domain in templates.DOMAINS:
        prompts = [p.text for p in domain_prompts(domain, 2000)]
        assert len(prompts) == 2000
        assert not [text for text in prompts if overlaps(text)]


def test_a_drawn_prompt_that_overlaps_mtbench_is_replaced_by_another(monkeypatch):
    turns = [text for _, text in mtbench_turns() if len(text.split()) >= 12]
    made = iter(f"{turns[i // 2]} (variant {i})" if i % 2 else f"A clean prompt, number {i}." for i in range(1000))
    monkeypatch.setitem(templates.DOMAINS, "code", lambda rng: next(made))
    prompts = [p.text for p in domain_prompts("code", 50)]
    assert prompts == [f"A clean prompt, number {i}." for i in range(0, 100, 2)]  # 50 still, every other draw dropped


def test_the_classifiers_shipped_examples_are_the_templates_output():
    # `make classifier-data` writes them; the running router reads the file, not the templates
    shipped = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines()]
    assert shipped == templates.classifier_examples()


def test_the_shipped_tuning_prompts_are_the_templates_output():
    # `make tuning-prompts` writes them; `specmesh tune` reads the file
    assert load_prompts(TUNING_PROMPTS) == templates.tuning_prompts()


def test_tuning_prompts_are_held_out_of_training_the_classifier_and_mtbench():
    tuning = templates.tuning_prompts(per_domain=30)
    assert [p.category for p in tuning] == [d for d in templates.DOMAINS for _ in range(30)]
    texts = {p.text for p in tuning}
    assert len(texts) == len(tuning) and not [t for t in texts if overlaps(t)]
    trained = {p.text for d in templates.DOMAINS for p in domain_prompts(d, HELD_OUT_FROM)}
    classified = {p.text for d in templates.DOMAINS for p in domain_prompts(d, 400, seed=CLASSIFIER_SEED)}
    assert not texts & trained and not texts & classified
    # the seed alone would not do it: its draws repeat training prompts, which the set leaves out
    drawn = {p.text for d in templates.DOMAINS for p in domain_prompts(d, 200, seed=TUNING_SEED)}
    assert drawn & trained
