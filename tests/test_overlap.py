"""Training prompts never overlap MT-Bench: the shared 8-word-run filter, over every turn of its questions."""

from specmesh.distill.overlap import SHINGLE, Benchmark, mtbench_turns, overlapped_questions, overlaps
from specmesh.prompts import mtbench_prompts

HAWAII = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
          "must-see attractions.")  # MT-Bench question 81


def test_every_turn_of_the_80_questions_is_covered():
    turns = mtbench_turns()
    assert len({ident for ident, _ in turns}) == 80 and len(turns) == 160  # two turns each
    firsts = [text for _, text in turns[::2]]
    assert firsts == [p.text for p in mtbench_prompts()]
    assert all(overlaps(text) for _, text in turns)  # each turn, first or follow-up, overlaps itself


def test_a_text_sharing_an_8_word_run_is_caught_whatever_its_case_and_punctuation():
    assert SHINGLE == 8
    assert overlapped_questions(HAWAII) == [81]
    assert overlaps("Please write... A TRAVEL-BLOG post, about a recent trip to: Lisbon!")  # 8 words, respelled
    assert overlapped_questions("Please write a travel blog post about a recent trip to Lisbon.") == [81]


def test_a_text_sharing_only_7_words_is_kept():
    assert not overlaps("Please write a fun travel blog post about a recent trip home.")  # 7 words in a row, not 8
    assert not overlaps("Zebra travel blog post about a recent trip zebra")  # 7 words of the run, broken at both ends


def test_follow_up_turns_count_and_short_turns_are_matched_whole():
    # question 122's second turn, not its first
    assert overlapped_questions("Now we define a sequence of numbers in which each number is the sum of squares") == [122]
    assert overlapped_questions("Can you parallelize it?") == [121]  # a whole turn shorter than 8 words
    assert not overlaps("Can you parallelize it over four threads?")


def test_a_benchmark_of_any_texts():
    bench = Benchmark.of([(1, "one two three four five six seven eight nine"), (2, "Hi there")])
    assert bench.matches("zero ONE two three four five six seven, eight") == [1]
    assert bench.matches("two three four five six seven eight nine") == [1]
    assert bench.matches("one two three four five six seven") == []
    assert bench.matches("hi, THERE.") == [2] and not bench.overlaps("hi there you")


def test_distill_and_distill_feature_filter_what_they_are_given_whatever_its_source():
    import pytest

    from specmesh.distill.feature_recipe import distill_feature
    from specmesh.distill.overlap import without_benchmark
    from specmesh.distill.recipe import distill
    from specmesh.errors import InvalidArgument
    from specmesh.prompts import Prompt

    benchmark = [Prompt(q.text) for q in mtbench_prompts()[:3]]
    clean = Prompt("Write a haiku about a lighthouse keeper who collects sea glass.")
    assert without_benchmark([*benchmark, clean]) == [clean]
    # every prompt overlaps: refused on entry, before the model (here: none) is touched
    for train in (lambda prompts: distill(None, "code", prompts, None, None),
                  lambda prompts: distill_feature(None, prompts, None, None, (), "")):
        with pytest.raises(InvalidArgument, match="overlaps an MT-Bench question"):
            train(benchmark)
