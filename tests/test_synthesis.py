"""Training prompts written by the real embedded target (SmolLM2-135M-Instruct) for itself."""

import json

import pytest

from specmesh.distill.overlap import Benchmark
from specmesh.distill.synthesis import acceptable, classified_prompts, synthesize_requests, user_turn_prefix
from specmesh.errors import InvalidArgument
from specmesh.prompts import encode_chat
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.loading import EMBEDDED_DEFAULT, load_hf_model
from specmesh.speculation.assembly import eos_token_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    return load_hf_model(EMBEDDED_DEFAULT, dtype="float32", device="cpu")


def test_the_user_turn_prefix_is_where_a_chat_request_begins(target):
    prefix = user_turn_prefix(target.tokenizer)
    request = encode_chat(target.tokenizer, "How do tides work?")
    assert len(prefix) >= 3 and request[: len(prefix)] == prefix  # system turn and user header, nothing of the text
    assert "How" not in target.tokenizer.decode(prefix)


def test_requests_are_whole_new_and_never_a_benchmark_question(target, tmp_path):
    runtime = LlamaRuntime(target.model)
    eos = eos_token_ids(target)
    cache = tmp_path / "requests.jsonl"
    first = synthesize_requests(runtime, target.tokenizer, 3, cache, eos, max_tokens=64, batch_size=8, seed=1)
    assert len(first) == 3 and len(set(first)) == 3
    for text in first:
        assert text.strip() == text and 16 <= len(text) <= 800
        assert encode_chat(target.tokenizer, text)  # a user message the chat template takes
    assert [json.loads(line) for line in cache.read_text().splitlines()] == first

    # Grown from the cache, not redrawn; a text to avoid is never kept, nor anything sharing 8 words with it.
    more = synthesize_requests(runtime, target.tokenizer, 5, cache, eos, max_tokens=64, batch_size=8, seed=1,
                               avoid=[first[0]])
    assert more[:3] == first and len(more) == 5 and len(set(more)) == 5
    assert len(cache.read_text().splitlines()) == 5


def test_acceptable_requests():
    avoid = Benchmark.of([(0, "explain the difference between weather and climate to a child")])
    assert acceptable("Can you help me plan a week of vegetarian dinners?", set(), avoid)
    assert not acceptable("Hi there", set(), avoid)  # too short to be a request
    assert not acceptable("x" * 801, set(), avoid)
    assert not acceptable("Please plan a week of meals\x07 for me, thanks", set(), avoid)  # control characters
    assert not acceptable("Can you help me plan a week of vegetarian dinners?",
                          {"can you help me plan a week of vegetarian dinners"}, avoid)  # seen, up to case and punctuation
    assert not acceptable("Briefly, explain the difference between weather and climate to a child.", set(), avoid)


def test_a_request_overlapping_mtbench_is_never_acceptable():
    assert acceptable("Write a travel blog post about my weekend in Kyoto.", set())
    assert not acceptable("Write a travel blog post about a recent trip to Kyoto, please.", set())  # question 81
    # question 122's follow-up turn
    assert not acceptable("Now we define a sequence of numbers in which each number is the sum of the two before.", set())


def test_a_cached_pool_is_filtered_again(target, tmp_path):
    cache = tmp_path / "requests.jsonl"
    pool = ["How do I repot a cactus without getting hurt?", "Compose an engaging travel blog post about a recent trip "
            "to Hawaii.", "What should I pack for a week of hiking in Wales?"]
    cache.write_text("".join(json.dumps(text) + "\n" for text in pool))
    kept = synthesize_requests(LlamaRuntime(target.model), target.tokenizer, 2, cache, eos_token_ids(target))
    assert kept == [pool[0], pool[2]]  # enough clean ones cached: nothing drawn, the MT-Bench one left out


def test_requests_are_kept_by_their_classified_kind():
    kinds = {"Write a Python function that sorts a list.": "code", "Write a poem about rain.": "writing",
             "What is 3 + 4?": "math", "Why is the sky blue?": "knowledge", "Hello, how are you today?": "general"}
    texts = list(kinds)
    writing = classified_prompts(texts, "writing", kinds.get)
    assert [p.text for p in writing] == ["Write a poem about rain."] and writing[0].category == "writing"
    chat = classified_prompts(texts, "general", kinds.get)  # the general chat expert: all but code and math
    assert [p.text for p in chat] == texts[1:2] + texts[3:]


def test_a_bad_count_is_one_clear_error(target, tmp_path):
    with pytest.raises(InvalidArgument, match="synthesize"):
        synthesize_requests(LlamaRuntime(target.model), target.tokenizer, 0, tmp_path / "r.jsonl", eos_token_ids(target))
