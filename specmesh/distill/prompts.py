"""Templated training prompts per domain. Never MT-Bench's questions: those are the benchmark.

Each domain combines task templates with fillers drawn by a seeded generator, so any number of
distinct prompts can be made reproducibly.
"""

from __future__ import annotations

import random

from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt

_LANGUAGES = ["Python", "JavaScript", "C++", "Java", "Go", "Rust", "TypeScript", "C", "Ruby", "Bash"]
_CODE_TASKS = [
    "reverses a linked list", "checks whether a number is prime", "merges two sorted lists",
    "counts the words in a text file", "computes the factorial of n", "finds the longest common prefix of strings",
    "removes duplicates from a list while keeping order", "converts a Roman numeral to an integer",
    "validates an email address", "computes the nth Fibonacci number iteratively", "flattens a nested list",
    "finds the maximum subarray sum", "implements binary search", "parses a CSV line into fields",
    "transposes a matrix", "checks whether parentheses are balanced", "computes the GCD of two numbers",
    "sorts a list of dictionaries by a key", "returns the k most frequent elements", "implements a stack class",
    "implements a queue with two stacks", "detects a cycle in a linked list", "computes the edit distance",
    "generates all permutations of a string", "converts Celsius to Fahrenheit", "reads a JSON file and prints a field",
    "rotates an array by k positions", "finds the second largest number", "checks if two strings are anagrams",
    "implements quicksort", "implements merge sort", "counts vowels in a string", "computes the mean and median",
    "builds a frequency table of characters", "finds all primes below n with a sieve", "capitalizes each word",
    "implements an LRU cache", "performs a breadth-first search on a graph", "computes the power set of a list",
    "checks whether a string is a palindrome", "converts a decimal number to binary", "chunks a list into batches",
    "retries a function call with exponential backoff", "memoizes a recursive function", "zips two lists into a dict",
]
_CODE_FORMS = [
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}. Include a short docstring and an example.",
    "How would you write code in {lang} that {task}? Explain your approach.",
    "Implement, in {lang}, a program that {task}, and explain its time complexity.",
    "Give me a {lang} snippet that {task}, with comments.",
    "Write unit tests in {lang} for a function that {task}.",
    "Explain step by step how a {lang} function that {task} works.",
]
_CODE_CONCEPTS = [
    "recursion", "a hash table", "big-O notation", "a closure", "garbage collection", "a race condition",
    "dependency injection", "a REST API", "SQL joins", "git rebase", "unit testing", "a binary tree",
    "dynamic programming", "object-oriented inheritance", "exceptions", "list comprehensions", "async/await",
    "a memory leak", "type hints", "regular expressions", "a linked list", "the difference between a process and a thread",
]
_CODE_CONCEPT_FORMS = ["Explain {concept} to a junior programmer, with a code example.",
                       "What is {concept}? Show an example in {lang}.",
                       "What are common mistakes with {concept} in {lang}?"]

_NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam"]
_ITEMS = ["apples", "books", "pencils", "tickets", "cookies", "marbles", "stickers", "oranges", "cards", "shirts"]


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 12)
    name, other, item = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS)
    price = rng.choice([0.5, 1.25, 2, 3.5, 4, 7.5, 12])
    pct = rng.choice([5, 10, 12, 15, 20, 25, 30, 40])
    templates = [
        f"{name} has {a} {item} and buys {b} more. Then {name} gives {c} to {other}. How many {item} does {name} have now?",
        f"A shop sells {item} at ${price} each. How much do {a} {item} cost? Show your work.",
        f"Solve for x: {c}x + {a} = {a + c * b}.",
        f"Solve the equation {c}x - {b} = {c * a - b} and check your answer.",
        f"What is {pct}% of {a * 10}? Explain the steps.",
        f"A train travels {a * 5} km in {c} hours. What is its average speed?",
        f"Find the area and the perimeter of a rectangle that is {a} cm long and {b} cm wide.",
        f"What is the sum of all integers from 1 to {a * 3}?",
        f"If {c} workers build a wall in {b} days, how long would {c * 2} workers take at the same rate?",
        f"A price of ${a * 4} is reduced by {pct}%. What is the new price?",
        f"Is {a * b + 1} a prime number? Explain your reasoning.",
        f"What is the least common multiple of {a} and {b}?",
        f"Compute {a} * {b} - {c} * {a}, step by step.",
        f"The average of three numbers is {a}. Two of them are {b} and {c}. What is the third?",
        f"{name} is {a} years old and {other} is {b} years older. How old will {other} be in {c} years?",
        f"A bag has {a} red balls and {b} blue balls. What is the probability of drawing a red ball?",
        f"Find the next number in the sequence {c}, {2 * c}, {4 * c}, {8 * c}, ... and explain the pattern.",
        f"Convert {a * 100} minutes into hours and minutes.",
        f"Simplify the fraction {a * c}/{b * c}.",
        f"What is the derivative of {c}x^2 + {b}x + {a}?",
        f"Evaluate the integral of {c}x + {b} from 0 to {min(a, 9)}.",
        f"There are {a} students; {pct}% of them play chess. How many play chess?",
        f"If all {item} are red and some red things are heavy, can we conclude that some {item} are heavy? Explain.",
        f"{name} is taller than {other}, and {other} is taller than {rng.choice(_NAMES)}. Who is the shortest? Explain.",
        f"A clock shows {c}:{rng.choice(['00', '15', '30', '45'])}. What angle do the hour and minute hands make?",
    ]
    return rng.choice(templates)


_WRITING_TOPICS = [
    "a lighthouse keeper", "a lost dog finding its way home", "the first day at a new school", "a city in the rain",
    "a robot learning to paint", "an old bookshop", "a summer by the sea", "a mountain village in winter",
    "a friendship between a cat and a crow", "the last tree on a planet", "a chef who lost her sense of taste",
    "a journey on a night train", "a garden that grows overnight", "a musician's first concert", "moving to a new country",
    "a forgotten letter", "an astronaut's view of Earth", "a storm at sea", "a small town festival", "a secret door",
]
_WRITING_SUBJECTS = [
    "the benefits of reading every day", "why sleep matters", "remote work", "learning a second language",
    "the history of the bicycle", "how to stay motivated", "the importance of friendship", "climate change",
    "healthy breakfast ideas", "how volcanoes form", "the invention of the printing press", "city parks",
    "saving money as a student", "public libraries", "time management", "the role of bees in nature",
    "the ocean's tides", "social media and teenagers", "travelling on a budget", "kindness at work",
]
_WRITING_FORMS = [
    "Write a short story about {topic}.", "Write a poem about {topic}.", "Describe {topic} in vivid detail.",
    "Write the opening paragraph of a novel about {topic}.", "Write a diary entry about {topic}.",
    "Write a short essay on {subject}.", "Give me five tips about {subject}.", "Explain {subject} to a child.",
    "Write a blog post about {subject}.", "Write a persuasive paragraph about {subject}.",
    "Summarize the main ideas of {subject} in a few sentences.", "What are the pros and cons of {subject}?",
    "Write a polite email to a colleague about {subject}.", "Write a product description for a book about {subject}.",
    "Tell me about {subject}.", "Write a speech about {subject} for a school assembly.",
    "Pretend you are a tour guide and describe {topic}.", "Write a dialogue between two friends about {subject}.",
]


def _code_prompt(rng: random.Random) -> str:
    if rng.random() < 0.75:
        return rng.choice(_CODE_FORMS).format(lang=rng.choice(_LANGUAGES), task=rng.choice(_CODE_TASKS))
    return rng.choice(_CODE_CONCEPT_FORMS).format(concept=rng.choice(_CODE_CONCEPTS), lang=rng.choice(_LANGUAGES))


def _writing_prompt(rng: random.Random) -> str:
    return rng.choice(_WRITING_FORMS).format(topic=rng.choice(_WRITING_TOPICS), subject=rng.choice(_WRITING_SUBJECTS))


DOMAINS = {"code": _code_prompt, "math": _math_prompt, "writing": _writing_prompt}


def domain_prompts(domain: str, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` distinct templated prompts of one domain (fewer if the templates run out)."""
    if domain not in DOMAINS:
        raise InvalidArgument("domain", f"unknown domain {domain!r}; templated domains: {', '.join(DOMAINS)}")
    rng = random.Random(f"{domain}-{seed}")
    seen: dict[str, None] = {}
    for _ in range(count * 20):
        if len(seen) >= count:
            break
        seen.setdefault(DOMAINS[domain](rng), None)
    return [Prompt(text, domain) for text in seen]
