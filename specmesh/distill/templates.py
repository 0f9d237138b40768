"""Templated training prompts per domain. Never MT-Bench's questions: those are the benchmark.

No prompt shares an 8-word run with an MT-Bench question (``domain_prompts`` draws again when one does), and
no form paraphrases a particular MT-Bench question (its task with other fillers: a travel blog post about a
trip, a persuasive email to a friend, the area of a triangle from its vertices, ...); those were removed
(docs/experiments/2026-11-25-training-overlap.md). Generic tasks of the benchmark's categories stay.

Each domain combines many task forms with fillers (subjects, snippets, passages, numbers) drawn by a
seeded generator, so thousands of distinct prompts can be made reproducibly. Breadth of wording, topic,
length and task type is the point: the drafters trained on the answers must generalise to real chat
requests, and a few dozen templates made them overfit.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from specmesh.distill.overlap import overlaps
from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt


def _tuples(value):
    """JSON's lists as the tuples the forms were written as (so they compare, hash and join as before)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


# the forms' fillers: names, tasks, snippets, passages' parts (data, not code)
_FILLERS = {name: _tuples(value) for name, value in
            json.loads(Path(__file__).with_name("template_words.json").read_text()).items()}


def _a(phrase: str) -> str:
    return ("an " if phrase[:1].lower() in "aeiou" else "a ") + phrase


def _money(x: float) -> str:
    return f"${x:,.0f}" if x == int(x) else f"${x:,.2f}"


_FIRST = _FILLERS["first"]
_MEN = _FILLERS["men"]
_WOMEN = _FILLERS["women"]
_SURNAMES = _FILLERS["surnames"]

_WEEKDAYS = _FILLERS["weekdays"]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST + _MEN + _WOMEN)} {rng.choice(_SURNAMES)}"


# ---- code ----

_LANGS = _FILLERS["langs"]
_OO_LANGS = _FILLERS["oo_langs"]
_FENCE = _FILLERS["fence"]
_FUNCTION_TASKS = _FILLERS["function_tasks"]
_CLASS_TASKS = _FILLERS["class_tasks"]
_PROGRAM_TASKS = _FILLERS["program_tasks"]
_CODE_CONSTRAINTS = _FILLERS["code_constraints"]
_STYLE_CONSTRAINTS = _FILLERS["style_constraints"]
_PY_EXTRAS = _FILLERS["py_extras"]
_FUNCTION_FORMS = _FILLERS["function_forms"]
_CLASS_FORMS = _FILLERS["class_forms"]
_PROGRAM_FORMS = _FILLERS["program_forms"]
# (language, what it should do, what goes wrong, code with the bug)
_BUGGY = _FILLERS["buggy"]
_BUG_FORMS = _FILLERS["bug_forms"]
_SNIPPETS = _FILLERS["snippets"]
_FN_NAMES = _FILLERS["fn_names"]
_SEQ_NAMES = _FILLERS["seq_names"]
_RECORDS = _FILLERS["records"]


def _made_snippet(rng: random.Random) -> tuple[str, str]:
    """A short snippet with drawn names, operators and constants, so that snippet prompts don't repeat."""
    fn, (xs, x), op, k = rng.choice(_FN_NAMES), rng.choice(_SEQ_NAMES), rng.choice((">", ">=", "<", "!=")), rng.randint(2, 9)
    key, val = rng.choice((("city", "temperature"), ("team", "points"), ("category", "price"), ("author", "pages")))
    items, r, num, num2 = rng.choice(_RECORDS)
    agg = rng.choice(("sum", "max", "min", "len"))
    return rng.choice((
        ("Python", f"def {fn}({xs}, limit):\n    total = 0\n    count = 0\n    for {x} in {xs}:\n        if {x} {op} limit:\n"
                   f"            total += {x}\n            count += 1\n    return total / count if count else 0"),
        ("Python", f"def {fn}(records):\n    groups = {{}}\n    for r in records:\n"
                   f"        groups.setdefault(r[\"{key}\"], []).append(r[\"{val}\"])\n"
                   f"    return {{k: {agg}(v) for k, v in groups.items()}}"),
        ("Python", f"def {fn}(n):\n    steps = 0\n    while n > 1:\n        n //= {k}\n        steps += 1\n    return steps"),
        ("Python", f"def {fn}({xs}):\n    count = 0\n    for i in range(len({xs})):\n        for j in range(i + 1, len({xs})):\n"
                   f"            if {xs}[i] {op} {xs}[j]:\n                count += 1\n    return count"),
        ("Python", f"def {fn}(text):\n    result = []\n    for word in text.split():\n"
                   f"        result.append(word[::-1] if len(word) > {k} else word)\n    return \" \".join(result)"),
        ("JavaScript", f"const result = {items}\n  .filter(({r}) => {r}.{num} {op} {k * 10})\n  .map(({r}) => {r}.{num2})\n"
                       "  .reduce((a, b) => a + b, 0);"),
        ("JavaScript", f"function {fn}({xs}) {{\n  const counts = {{}};\n  for (const {x} of {xs}) {{\n"
                       f"    counts[{x}] = (counts[{x}] || 0) + 1;\n  }}\n"
                       "  return Object.entries(counts).sort((a, b) => b[1] - a[1])[0];\n}"),
    ))


_SNIPPET_FORMS = _FILLERS["snippet_forms"]
# (schema as words, questions over it)
_SCHEMAS = _FILLERS["schemas"]
_SQL_FORMS = _FILLERS["sql_forms"]
_PAGES = _FILLERS["pages"]
_PAGE_FORMS = _FILLERS["page_forms"]
_REGEXES = _FILLERS["regexes"]
_REGEX_FORMS = _FILLERS["regex_forms"]
_SHELL_TASKS = _FILLERS["shell_tasks"]
_SHELL_FORMS = _FILLERS["shell_forms"]
_CONCEPTS = _FILLERS["concepts"]
_CONCEPT_FORMS = _FILLERS["concept_forms"]
_ALGORITHMS = _FILLERS["algorithms"]
_ALGORITHM_FORMS = _FILLERS["algorithm_forms"]
_CODE_PAIRS = _FILLERS["code_pairs"]
_CODE_PAIR_FORMS = _FILLERS["code_pair_forms"]
_CODE_INTROS = _FILLERS["code_intros"]


def _fence(lang: str, code: str) -> str:
    return f"```{_FENCE.get(lang, lang.lower())}\n{code}\n```"


def _code_prompt(rng: random.Random) -> str:
    lang = rng.choice(("Python", "Python", "JavaScript")) if rng.random() < 0.35 else rng.choice(_LANGS)
    cons = rng.choice(_CODE_CONSTRAINTS)
    if lang == "Python" and rng.random() < 0.3:
        cons = rng.choice(_PY_EXTRAS) + cons
    kind = rng.random()
    if kind < 0.28:
        text = rng.choice(_FUNCTION_FORMS).format(lang=lang, task=rng.choice(_FUNCTION_TASKS), cons=cons)
    elif kind < 0.35:
        lang = lang if lang in _OO_LANGS else rng.choice(_OO_LANGS)
        text = rng.choice(_CLASS_FORMS).format(lang=lang, task=rng.choice(_CLASS_TASKS), cons=rng.choice(_STYLE_CONSTRAINTS))
    elif kind < 0.42:
        text = rng.choice(_PROGRAM_FORMS).format(lang=lang, task=rng.choice(_PROGRAM_TASKS), cons=rng.choice(_STYLE_CONSTRAINTS))
    elif kind < 0.54:
        blang, purpose, symptom, code = rng.choice(_BUGGY)
        text = rng.choice(_BUG_FORMS).format(lang=blang, purpose=purpose, symptom=symptom, code=_fence(blang, code))
    elif kind < 0.66:
        slang, code = rng.choice(_SNIPPETS) if rng.random() < 0.5 else _made_snippet(rng)
        other = rng.choice([x for x in ("Python", "JavaScript", "Go", "Rust", "Java", "C++", "TypeScript") if x != slang])
        text = rng.choice(_SNIPPET_FORMS).format(lang=slang, other=other, code=_fence(slang, code))
    elif kind < 0.73:
        schema, questions = rng.choice(_SCHEMAS)
        text = rng.choice(_SQL_FORMS).format(schema=schema, q=rng.choice(questions),
                                             dialect=rng.choice(("PostgreSQL", "MySQL", "SQLite", "standard SQL")))
    elif kind < 0.78:
        text = rng.choice(_PAGE_FORMS).format(page=rng.choice(_PAGES))
    elif kind < 0.82:
        text = rng.choice(_REGEX_FORMS).format(r=rng.choice(_REGEXES), lang=lang)
    elif kind < 0.86:
        text = rng.choice(_SHELL_FORMS).format(s=rng.choice(_SHELL_TASKS))
    elif kind < 0.93:
        text = rng.choice(_CONCEPT_FORMS).format(c=rng.choice(_CONCEPTS), lang=lang)
    elif kind < 0.97:
        text = rng.choice(_ALGORITHM_FORMS).format(a=rng.choice(_ALGORITHMS), lang=lang, cons=cons)
    else:
        a, b = rng.choice(_CODE_PAIRS)
        text = rng.choice(_CODE_PAIR_FORMS).format(a=a, b=b)
    return rng.choice(_CODE_INTROS) + text


# ---- math ----

_ITEMS = _FILLERS["items"]
_MATH_ASKS = _FILLERS["math_asks"]
_ORD = _FILLERS["ord"]


def _lin(a: int, b: int, var: str = "x") -> str:
    """a*var + b, written the way a person would."""
    head = var if a == 1 else f"-{var}" if a == -1 else f"{a}{var}"
    return head if b == 0 else f"{head} + {b}" if b > 0 else f"{head} - {-b}"


def _poly(coefs: list[int]) -> str:
    """Coefficients from the highest power down, in x."""
    terms = []
    for power, c in zip(range(len(coefs) - 1, -1, -1), coefs):
        if c == 0:
            continue
        body = "" if power == 0 else "x" if power == 1 else f"x^{power}"
        mag = str(abs(c)) if abs(c) != 1 or power == 0 else ""
        terms.append(("-" if c < 0 else "+", mag + body))
    if not terms:
        return "0"
    out = ("-" if terms[0][0] == "-" else "") + terms[0][1]
    return out + "".join(f" {s} {t}" for s, t in terms[1:])


def _clock(minutes: int) -> str:
    h, m = divmod(minutes % (24 * 60), 60)
    return f"{(h - 1) % 12 + 1}:{m:02d} {'am' if h < 12 else 'pm'}"


def _m_money(rng: random.Random) -> str:
    n, (i1, i2) = rng.choice(_FIRST), rng.sample(_ITEMS, 2)
    q1, q2 = rng.randint(2, 9), rng.randint(2, 9)
    p1, p2 = rng.randint(50, 900) / 100, rng.randint(50, 1500) / 100
    total = q1 * p1 + q2 * p2
    bill = next(b for b in (10, 20, 50, 100, 200, 500) if b > total)
    rate, hours = rng.randint(12, 40), rng.randint(41, 55)
    weekly, goal = rng.randint(8, 60), rng.randint(150, 1200)
    return rng.choice((
        f"{n} buys {q1} {i1} at {_money(p1)} each and {q2} {i2} at {_money(p2)} each, paying with a {_money(bill)} note. How "
        f"much change should {n} get?",
        f"{n} earns {_money(rate)} per hour and gets time-and-a-half for every hour over 40 in a week. How much does {n} earn "
        f"for a {hours}-hour week?",
        f"{n} saves {_money(weekly)} every week. How many weeks will it take to save at least {_money(goal)}?",
        f"{rng.randint(3, 8)} friends share a restaurant bill of {_money(rng.randint(60, 400))} and add a "
        f"{rng.choice((10, 12, 15, 18, 20))}% tip. How much does each person pay?",
        f"A phone plan costs {_money(rng.randint(10, 30))} a month plus {_money(rng.randint(5, 20) / 100)} per text. {n} paid "
        f"{_money(rng.randint(31, 60))} last month. Set up an equation for the number of texts and solve it, rounding down.",
    ))


def _m_time(rng: random.Random) -> str:
    start, dur = rng.randint(6 * 60, 21 * 60), rng.randint(25, 300)
    a, b = sorted(rng.sample(range(5 * 60, 23 * 60, 5), 2))
    return rng.choice((
        f"A film starts at {_clock(start)} and runs for {dur // 60} hours and {dur % 60} minutes. At what time does it end?",
        f"A train leaves at {_clock(a)} and arrives at {_clock(b)} the same day. How long is the journey in hours and minutes?",
        f"How many minutes are there between {_clock(a)} and {_clock(b)}?",
        f"A recipe needs {dur} minutes of baking, and dinner must be ready by {_clock(start + dur)}. When should the oven go on?",
        f"Convert {rng.randint(100, 9000)} seconds into hours, minutes and seconds.",
    ))


def _m_rates(rng: random.Random) -> str:
    v1, v2, t = rng.randint(40, 120), rng.randint(40, 120), rng.randint(2, 6)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    x, y = rng.sample(_FIRST, 2)
    return rng.choice((
        f"A car travels {v1 * t} km in {t} hours. What is its average speed, and how far would it go in {t + 3} hours at that "
        "speed?",
        f"Two trains start {(v1 + v2) * t} km apart and travel toward each other at {v1} km/h and {v2} km/h. How long until "
        "they meet?",
        f"A cyclist rides {v1 // 4 * 6} km to work at {v1 // 4} km/h and back at {v2 // 4 + 1} km/h. What is the average speed "
        "for the round trip?",
        f"{x} can paint a fence in {a} hours and {y} can paint it in {b} hours. How long will it take if they work together?",
        f"One pipe fills a tank in {a} hours; a second pipe fills it in {b} hours. With both open, how long does it take to "
        "fill?",
        f"A printer prints {a * 5} pages per minute. How long does it need for a {a * 5 * t * 7 + b}-page job?",
        f"{x} leaves home walking at {a % 5 + 3} km/h. {b * 5} minutes later, {y} follows on a bike at {a % 5 + 12} km/h. How "
        f"long does {y} take to catch up?",
    ))


def _m_mixtures_ages(rng: random.Random) -> str:
    p2, p3 = rng.randint(5, 20), rng.randint(25, 40)
    p1, v = rng.randint(p3 + 5, 70), rng.randint(2, 20)
    x, y = rng.sample(_FIRST, 2)
    b, d, n = rng.randint(4, 30), rng.randint(2, 30), rng.randint(2, 15)
    k = rng.randint(2, 4)
    return rng.choice((
        f"How many litres of a {p1}% salt solution must be added to {v} litres of a {p2}% solution to get a {p3}% solution?",
        f"{rng.randint(2, 9)} kg of coffee costing {_money(rng.randint(8, 14))} per kg is mixed with {rng.randint(2, 9)} kg "
        f"costing {_money(rng.randint(15, 25))} per kg. What does the mixture cost per kg?",
        f"The sum of {x}'s and {y}'s ages is {2 * b + d}. {x} is {d} years older than {y}. How old is each of them?",
        f"{x} is {('twice', 'three times', 'four times')[k - 2]} as old as {y}. In {n} years, {x} will be "
        f"{k * (b % 12 + 3) + n} years old. How old is {y} now?",
        f"{n} years ago, {x} was {b + d} and {y} was {b}. In how many years will the sum of their ages be "
        f"{2 * b + d + 2 * n + 10}?",
        f"A jug holds {v + 5} litres of juice that is {p2}% orange. How much pure orange juice must be added to make it {p3}% "
        "orange?",
    ))


def _m_percent_ratio(rng: random.Random) -> str:
    p, q = rng.choice((5, 10, 15, 20, 25, 30, 40)), rng.choice((10, 20, 25, 50))
    orig = rng.randint(4, 60) * 5
    a, b, c = rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 5)
    x, y = rng.sample(_FIRST, 2)
    return rng.choice((
        f"A price rises by {p}% and then falls by {p}%. Is it back to the original price? If not, by what percent has it "
        "changed?",
        f"After a {p}% discount, a jacket costs {_money(orig * (100 - p) / 100)}. What was the original price?",
        f"What is {rng.randint(3, 90)} as a percentage of {rng.randint(100, 400)}? Round to one decimal place.",
        f"A town of {rng.randint(10, 90) * 1000:,} people grows by {rng.randint(1, 6)}% a year. What will the population be "
        f"after {rng.randint(2, 5)} years?",
        f"{_money(orig * (a + b))} is shared between {x} and {y} in the ratio {a}:{b}. How much does each get?",
        f"A recipe for {c + 1} people uses {rng.randint(2, 8) * 50} g of flour. How much flour is needed for "
        f"{c + rng.randint(3, 9)} people?",
        f"The ratio of boys to girls in a club is {a}:{b + a}, and there are {(2 * a + b) * rng.randint(2, 9)} members. How "
        "many girls are there?",
        f"{_money(orig * 10)} is invested at {rng.randint(2, 8)}% simple interest for {c + 1} years. How much interest is "
        "earned?",
        f"{_money(orig * 10)} is invested at {rng.randint(2, 8)}% interest compounded yearly. What is it worth after {c + 2} "
        "years?",
        f"In a test, {x} scored {rng.randint(30, 48)} out of 50. What percentage is that, and is it an A if an A needs "
        f"{rng.choice((70, 80, 85, 90))}%?",
        f"A shop marks up items by {q}% and then offers {p}% off. What is the final price of an item that cost the shop "
        f"{_money(orig)}?",
    ))


def _m_algebra(rng: random.Random) -> str:
    x, y = rng.randint(-9, 12), rng.randint(-9, 12)
    a = rng.choice((2, 3, 4, 5, 6, 7))
    c = rng.randint(1, a - 1)
    b = rng.randint(-20, 20)
    d = a * x + b - c * x
    r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
    p, q, s, t = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6), rng.randint(-6, 6) or 1
    n, lo = rng.randint(2, 6), rng.randint(-6, 3)
    return rng.choice((
        f"Solve for x: {_lin(a, b)} = {_lin(c, d)}.",
        f"Solve the equation {_poly([1, -(r1 + r2), r1 * r2])} = 0.",
        f"Factor the expression {_poly([1, -(r1 + r2), r1 * r2])}.",
        f"Find the vertex of the parabola y = {_poly([1, -2 * r1, r1 * r1 + r2])}.",
        f"Solve the system of equations: {p}x + {q}y = {p * x + q * y} and {s}x - {abs(t)}y = {s * x - abs(t) * y}.",
        f"Solve the inequality {_lin(a, b)} > {_lin(c, d)}.",
        f"Solve the inequality {_lin(-a, b)} <= {-a * x + b} and describe the solution on a number line.",
        f"Solve {2 * lo + b} < {_lin(2, b)} <= {2 * (lo + n) + b}.",
        f"Expand and simplify ({_lin(p, t)})({_lin(1, -q)}).",
        f"Simplify {a}({_lin(1, p)}) - {c + 1}({_lin(1, -q)}).",
        f"Find the inverse of the function f(x) = ({_lin(a, b)})/{c + 1}.",
        f"Solve for x: 2^(x + {c}) = {2 ** (n + c)}.",
        f"Three times a number, increased by {abs(b) + 1}, equals {3 * x + abs(b) + 1}. What is the number?",
        f"Adult tickets cost {_money(p + 7)} and child tickets {_money(q + 1)}. {abs(x) + 20} tickets were sold for "
        f"{_money((p + 7) * (abs(x) + 5) + (q + 1) * 15)}. How many of each were sold?",
        f"For which values of k does x^2 + kx + {n} = 0 have two distinct real roots?",
        f"Evaluate log base {c + 1} of {(c + 1) ** n}, and explain what a logarithm means.",
    ))


def _m_geometry(rng: random.Random) -> str:
    while True:
        (x1, y1), (x2, y2), (x3, y3) = [(rng.randint(-8, 10), rng.randint(-8, 10)) for _ in range(3)]
        if (x2 - x1) * (y3 - y1) != (x3 - x1) * (y2 - y1):
            break
    w, h, r = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 20)
    k, (p, _, hyp) = rng.randint(1, 5), rng.choice(((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29)))
    a1, a2 = rng.randint(20, 80), rng.randint(20, 80)
    sides = rng.randint(5, 12)
    shape = rng.choice(("cylinder", "cone"))
    return rng.choice((
        f"A triangle has vertices at A({x1}, {y1}), B({x2}, {y2}) and C({x3}, {y3}). Find its perimeter, to two decimal places.",
        f"Find the distance and the midpoint between the points ({x1}, {y1}) and ({x3 if x3 != x1 else x1 + 3}, {y3}).",
        f"Find the equation of the line through ({x1}, {y1}) and ({x1 + k}, {y2}).",
        f"Find the area and the perimeter of a rectangle {w} cm long and {h} cm wide.",
        f"A rectangle has an area of {w * h} square metres and one side of {w} m. How long is the diagonal?",
        f"Find the area and the circumference of a circle with {'radius' if r % 2 else 'diameter'} {r} cm.",
        f"A circular pizza has a diameter of {2 * r + 10} cm. What is the area of a slice if it is cut into {k + 5} equal "
        "slices?",
        f"A ladder {hyp * k} m long leans against a wall with its foot {p * k} m from the wall. How high up the wall does it "
        "reach?",
        f"The legs of a right triangle are {w} and {h}. How long is the hypotenuse?",
        f"Two angles of a triangle are {a1} and {min(a2, 150 - a1)} degrees. What is the third angle?",
        f"What is the size of each interior angle of a regular polygon with {sides} sides?",
        f"What is the volume of a box {w} cm by {h} cm by {r} cm, and how many litres does it hold?",
        f"A {shape} has a radius of {r} cm and a height of {h} cm. What is its volume?",
        f"Find the volume and the surface area of a sphere with radius {r} m.",
        f"A {h} m tall tree casts a {w} m shadow. At the same time, a post casts a {k + 1} m shadow. How tall is the post?",
        f"A sector of a circle has radius {r} cm and a central angle of {rng.choice((30, 45, 60, 72, 90, 120, 150))} degrees. "
        "Find its area and arc length.",
        f"A square garden has a diagonal of {hyp * k} m. What is its area?",
    ))


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _m_numbers(rng: random.Random) -> str:
    a, b, n = rng.randint(6, 120), rng.randint(6, 120), rng.randint(100, 9999)
    base, exp, mod = rng.randint(2, 9), rng.randint(20, 400), rng.randint(3, 11)
    d = rng.randint(3, 12)
    lo = rng.randint(1, 150)
    return rng.choice((
        f"What is the remainder when {base}^{exp} is divided by {mod}?", f"What is the last digit of {base}^{exp}?",
        f"Is {n} divisible by 3, 4, 9 or 11? Use the divisibility rules.", f"Is {n} a prime number? Explain how you checked.",
        f"Find the prime factorisation of {a * b}.",
        f"Find the greatest common divisor and the least common multiple of {a} and {b}.",
        f"One bus leaves every {a % 20 + 6} minutes and another every {b % 25 + 8} minutes. Both leave at 8:00 am. When do they "
        "next leave together?",
        f"A floor measures {a * 10} cm by {b * 10} cm. What is the largest square tile that covers it exactly, and how many "
        "tiles are needed?",
        f"What is the sum of the digits of {n * 17}?",
        f"How many two-digit numbers have digits that add up to {rng.randint(3, 15)}?",
        f"What is the smallest positive integer whose digits add up to {rng.randint(10, 40)}?",
        f"How many prime numbers are there between {lo} and {lo + 30}? List them.",
        f"Convert {n % 500 + 12} to binary and to hexadecimal.", f"Convert the binary number {bin(n % 255 + 1)[2:]} to decimal.",
        f"How many integers from 1 to {n} are divisible by {d} or by {d + 1}?",
        f"How many trailing zeros does {rng.randint(20, 150)}! have?",
    ))


_WORDS = _FILLERS["words"]


def _m_chance(rng: random.Random) -> str:
    n, c = rng.randint(3, 8), rng.randint(2, 5)
    red, blue, green = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 6)
    card = rng.choice(("a heart", "a king", "a face card", "a red card", "an ace or a spade", "a number card from 2 to 10"))
    spam, catch, wrong = rng.randint(5, 40), rng.randint(80, 99), rng.randint(1, 8)
    return rng.choice((
        f"A fair die is rolled {n} times. What is the probability of getting at least one six?",
        "Two fair dice are rolled. What is the probability that the product of the numbers is even?",
        f"A fair coin is flipped {n} times. What is the probability of exactly {rng.randint(0, n)} heads?",
        f"What is the probability of getting at least one head in {n} flips of a fair coin?",
        f"One card is drawn from a standard 52-card deck. What is the probability that it is {card}?",
        "Two cards are drawn from a shuffled 52-card deck without replacement. What is the probability that both are "
        f"{rng.choice(('aces', 'hearts', 'red cards', 'face cards'))}?",
        f"A bag holds {red} red, {blue} blue and {green} green marbles. Two are drawn without replacement. What is the "
        "probability that they are the same colour?",
        f"A bag holds {red} red and {blue} blue balls. One ball is drawn, put back, and a second is drawn. What is the "
        "probability of getting one of each colour?",
        f"In how many different ways can the letters of the word {rng.choice(_WORDS)} be arranged?",
        f"In how many ways can {n} people sit in a row? And around a round table?",
        f"A committee of {c} is chosen from {n + c + 2} people. How many different committees are possible?",
        f"A team of {c} is chosen from {n} men and {red} women. In how many ways can this be done if it must include at least "
        "one woman?",
        f"How many {n}-digit PIN codes have no repeated digits?",
        f"A game costs {_money(c)} to play. You win {_money(c * n + red)} with probability 1/{n + 3}. What is the expected "
        "profit per game?",
        f"A café offers {n} starters, {c + 3} main courses and {blue} desserts. How many three-course meals are possible? How "
        "many if the starter is optional?",
        f"{spam}% of emails are spam. A filter catches {catch}% of spam but also flags {wrong}% of normal emails. If an email "
        "is flagged, what is the probability it is spam?",
    ))


def _m_sequences(rng: random.Random) -> str:
    a, d, g, r = rng.randint(-10, 20), rng.choice((-7, -5, -3, -2, 2, 3, 4, 5, 6, 9)), rng.randint(1, 6), rng.randint(2, 4)
    n, i, s, k = rng.randint(8, 40), rng.randint(2, 5), rng.randint(1, 5), rng.randint(-3, 5)
    j = i + rng.randint(3, 9)
    x, y = rng.randint(1, 5), rng.randint(1, 7)
    seq = rng.choice(([a + d * t for t in range(5)], [g * r ** t for t in range(5)], [(t + s) ** 2 + k for t in range(5)],
                      [x, y, x + y, x + 2 * y, 2 * x + 3 * y], [t * (t + 1) // 2 + k for t in range(s, s + 5)],
                      [a + (t // 2) * abs(d) if t % 2 == 0 else g + (t // 2) * r for t in range(6)]))  # two interleaved
    lo = rng.randint(1, 60)
    return rng.choice((
        f"Find the next two numbers in the sequence {', '.join(map(str, seq))}, ... and explain the pattern.",
        f"What comes next: {', '.join(map(str, seq))}? Explain the rule.",
        f"Find the {_nth(n)} term and the sum of the first {n} terms of the arithmetic sequence {a}, {a + d}, {a + 2 * d}, ...",
        f"Find the sum of the first {i + 4} terms of the geometric sequence {g}, {g * r}, {g * r * r}, ...",
        f"The {_nth(i)} term of an arithmetic sequence is {a + (i - 1) * d} and the {_nth(j)} term is {a + (j - 1) * d}. Find "
        "the first term and the common difference.",
        f"What is the sum of all the integers from {lo} to {lo + n * 3}?",
        f"What is the sum of all multiples of {i + 1} below {n * 10}?",
        f"Does the series 1 + 1/{r} + 1/{r}^2 + 1/{r}^3 + ... converge? If so, what is its sum?",
    ))


def _m_calculus(rng: random.Random) -> str:
    c = [rng.randint(1, 9) * rng.choice((1, -1))] + [rng.randint(-9, 9) for _ in range(rng.randint(2, 4))]
    a, b, n, lo = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 6), rng.randint(-2, 3)
    expr = rng.choice((f"{a}sin(x) + {b}cos(x)", f"x^{n} e^({a}x)", f"ln({a}x + {b})", f"({a}x + {b})^{n}", f"x^{n} sin(x)",
                       f"{a}/(x^2 + {b})", f"sqrt({a}x^2 + {b})", f"e^(-{a}x) cos({b}x)", f"tan({a}x)", "x ln(x)"))
    return rng.choice((
        f"Find the derivative of f(x) = {_poly(c)}.", f"Differentiate f(x) = {expr} and name the rules you used.",
        f"Evaluate the definite integral of {_poly(c[-3:])} from {lo} to {lo + n}.",
        f"Find the indefinite integral of {_poly(c)}.",
        f"Find the limit of (x^2 - {a * a})/(x - {a}) as x approaches {a}.",
        f"Find the maximum value of f(x) = {_poly([-1, 2 * a, b])} and the x at which it occurs.",
        f"Find the equation of the tangent line to y = {_poly([1, -a, b])} at x = {n}.",
        f"A farmer has {a * 40} m of fencing to enclose a rectangular field beside a straight river; no fence is needed along "
        "the river. What dimensions give the largest area?",
        f"Find the local maximum and minimum of f(x) = x^3 - {3 * a * a}x + {b}.",
        f"The radius of a balloon grows at {a} cm/s. How fast is its volume growing when the radius is {b * 5} cm?",
        f"What is the area enclosed between y = x^2 and y = {a}x?",
    ))


_UNITS = _FILLERS["units"]


def _m_units(rng: random.Random) -> str:
    src, dst = rng.choice(_UNITS)
    v = rng.choice((rng.randint(2, 500), rng.randint(10, 999) / 10))
    return rng.choice((
        f"Convert {v} {src} to {dst}.",
        f"How many {dst} are in {v} {src}?",
        f"Convert {rng.randint(-20, 110)} degrees Fahrenheit to Celsius.",
        f"Convert {rng.randint(-30, 45)} degrees Celsius to Fahrenheit and to kelvin.",
        f"A car uses {rng.randint(4, 12)} litres of fuel per 100 km. What is that in miles per US gallon?",
        f"A runner finishes a 10 km race in {rng.randint(38, 75)} minutes. What is the average pace per kilometre and per mile?",
        f"A room is {rng.randint(8, 25)} feet by {rng.randint(8, 25)} feet. What is its area in square metres?",
    ))


def _m_stats(rng: random.Random) -> str:
    data = [rng.randint(1, 60) for _ in range(rng.randint(5, 9))]
    scores = [rng.randint(60, 95) for _ in range(rng.randint(3, 5))]
    target = (sum(scores) + rng.randint(70, 100)) // (len(scores) + 1)
    n, m = rng.randint(5, 12), rng.randint(20, 80)
    m2 = m + rng.randint(-4, 4)
    removed = n * m - (n - 1) * m2
    return rng.choice((
        f"Find the mean, median, mode and range of: {', '.join(map(str, data))}.",
        f"{rng.choice(_FIRST)}'s test scores so far are {', '.join(map(str, scores))}. What score is needed on the next test to "
        f"average exactly {target}?",
        f"The mean of {n} numbers is {m}. After one number is removed, the mean of the rest is {m2}. What number was removed?"
        if removed > 0 else f"The mean of {n} numbers is {m}. What is their sum?",
        f"Find the population standard deviation of {', '.join(map(str, data[:6]))}.",
        f"A class of {n + 15} students averaged {m} on a test and a class of {n + 20} averaged {m2}. What is the overall "
        "average?",
    ))


# clue phrasing per scene; slot 0 is the first finisher, the tallest, the leftmost chair, the lowest floor
_SCENES = _FILLERS["scenes"]
# (intro, is, is not, ask about one, ask about all, values)
_ATTRIBUTES = _FILLERS["attributes"]
_TESTS = {"before": lambda p, a, b: p[a] < p[b], "after": lambda p, a, b: p[a] == p[b] + 1,
          "at": lambda p, a, k: p[a] == k, "not_at": lambda p, a, k: p[a] != k,
          "next": lambda p, a, b: abs(p[a] - p[b]) == 1, "apart": lambda p, a, b: abs(p[a] - p[b]) > 1}


def _clues(rng: random.Random, n: int, relations: list[str], truth: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """True clues (relation, item, item-or-slot), drawn until ``truth`` is the only arrangement left: a well-posed puzzle."""
    alive, clues = list(itertools.permutations(range(n))), []
    while len(alive) > 1:
        rel = rng.choice(relations)
        a = rng.randrange(n)
        b = rng.randrange(n) if rel in ("at", "not_at") else rng.choice([i for i in range(n) if i != a])
        test = _TESTS[rel]
        kept = [p for p in alive if test(p, a, b)] if test(truth, a, b) else alive
        if len(kept) < len(alive):
            alive, clues = kept, clues + [(rel, a, b)]
    rng.shuffle(clues)
    return clues


def _names_list(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1]


def _m_order_puzzle(rng: random.Random) -> str:
    n = rng.choice((3, 4, 4, 5))
    names = rng.sample(_FIRST, n)
    truth = tuple(rng.sample(range(n), n))
    if rng.random() < 0.5:
        intro, asks, phrases = rng.choice(_SCENES)
        # the direct "at" clue rarely, so that the puzzle needs some reasoning
        relations = [r for r in phrases for _ in range(1 if r in ("at", "not_at") else 3)]
        lines = [phrases[rel].format(a=names[a], b=names[b] if rel not in ("at", "not_at") else "",
                                     ord=_ORD[b], k=b + 1)
                 for rel, a, b in _clues(rng, n, relations, truth)]
        k = rng.randrange(n)
        ask = rng.choice(asks).format(ord=_ORD[k], k=k + 1)
        return f"{intro.format(names=_names_list(names), n=n)} {' '.join(lines)} {ask}"
    intro, is_, not_, ask_one, ask_all, values = rng.choice(_ATTRIBUTES)
    opts = rng.sample(values, n)
    lines = [(is_ if rel == "at" else not_).format(a=names[a], x=opts[b])
             for rel, a, b in _clues(rng, n, ["at", "not_at", "not_at"], truth)]
    ask = rng.choice((ask_all, ask_one.format(x=rng.choice(opts))))
    return f"{intro.format(names=_names_list(names), opts=_names_list(opts))} {' '.join(lines)} {ask}"


_ISLANDS = _FILLERS["islands"]


def _m_knights(rng: random.Random) -> str:
    """Statements drawn until exactly one assignment of truth-tellers and liars is consistent: a well-posed puzzle."""
    intro, yes, no = rng.choice(_ISLANDS)
    n = rng.choice((2, 3, 3))
    names = rng.sample(_FIRST, n)
    forms = {"yes": (lambda s, i, j: s[j], f"{{j}} is {_a(yes)}."), "no": (lambda s, i, j: not s[j], f"{{j}} is {_a(no)}."),
             "same": (lambda s, i, j: s[i] == s[j], f"{{j}} and I are both {yes}s or both {no}s."),
             "diff": (lambda s, i, j: s[i] != s[j], f"{{j}} and I are different: one {yes}, one {no}."),
             "none": (lambda s, i, j: not any(s), f"All of us are {no}s."),
             "one": (lambda s, i, j: sum(s) == 1, f"Exactly one of us is {_a(yes)}."),
             "some": (lambda s, i, j: not all(s), f"At least one of us is {_a(no)}.")}
    for _ in range(200):
        said = [(i, rng.choice(list(forms)), rng.choice([j for j in range(n) if j != i])) for i in range(n)]
        worlds = [s for s in itertools.product((True, False), repeat=n) if all(s[i] == forms[f][0](s, i, j) for i, f, j in said)]
        if len(worlds) == 1:
            break
    else:  # a known well-posed set
        said = [(0, "none", 1), (1, "some", 0), (2, "no", 0)][:n]
    lines = [f"{names[i]} says: \"{forms[f][1].format(j=names[j])}\"" for i, f, j in said]
    ask = rng.choice((f"Who is {_a(yes)} and who is {_a(no)}?", "What is each of them?", "Work out what each person is."))
    return f"{intro} {' '.join(lines)} {ask}"


_FAMILY = _FILLERS["family"]
_TERMS = _FILLERS["terms"]
_SYLLOGISMS = _FILLERS["syllogisms"]
# (if, then, then is false, then is true, if in the past)
_CONDITIONALS = _FILLERS["conditionals"]


def _m_reasoning(rng: random.Random) -> str:
    m1, m2, m3 = rng.sample(_MEN, 3)
    f1, f2 = rng.sample(_WOMEN, 2)
    A, B, C = rng.sample(_TERMS, 3)
    n = rng.choice(_FIRST)
    p, q, not_q, is_q, was_p = (s.format(n=n) for s in rng.choice(_CONDITIONALS))
    return rng.choice((
        rng.choice(_FAMILY).format(m1=m1, m2=m2, m3=m3, f1=f1, f2=f2), rng.choice(_SYLLOGISMS).format(A=A, B=B, C=C, n=n),
        f"If {p}, then {q}. {not_q} What can you conclude, and why?",
        f"If {p}, then {q}. {is_q} Can we conclude that {was_p}? Explain.",
    ))


_MATH_KINDS = ((_m_money, 2), (_m_time, 1), (_m_rates, 2), (_m_mixtures_ages, 1), (_m_percent_ratio, 2), (_m_algebra, 3),
               (_m_geometry, 3), (_m_numbers, 2), (_m_chance, 2), (_m_sequences, 1), (_m_calculus, 2), (_m_units, 1),
               (_m_stats, 1), (_m_order_puzzle, 2), (_m_knights, 1), (_m_reasoning, 1))
_MATH_INTROS = _FILLERS["math_intros"]


def _math_prompt(rng: random.Random) -> str:
    kind = rng.choices([k for k, _ in _MATH_KINDS], weights=[w for _, w in _MATH_KINDS])[0]
    return rng.choice(_MATH_INTROS) + kind(rng) + rng.choice(_MATH_ASKS)


# ---- writing ----

_TONES = _FILLERS["tones"]
_LENGTHS = _FILLERS["lengths"]
_AUDIENCES = _FILLERS["audiences"]
_STORY_TOPICS = _FILLERS["story_topics"]
_GENRES = _FILLERS["genres"]
_STORY_TWISTS = _FILLERS["story_twists"]
_STORY_FORMS = _FILLERS["story_forms"]
_POEM_TYPES = _FILLERS["poem_types"]
_POEM_SUBJECTS = _FILLERS["poem_subjects"]
_POEM_FORMS = _FILLERS["poem_forms"]
_ACROSTICS = _FILLERS["acrostics"]
_DESTINATIONS = _FILLERS["destinations"]
_ISSUES = _FILLERS["issues"]
_ESSAY_FORMS = _FILLERS["essay_forms"]
_PRODUCTS = _FILLERS["products"]
_PRODUCT_FORMS = _FILLERS["product_forms"]
_EMAILS = _FILLERS["emails"]
_EMAIL_FORMS = _FILLERS["email_forms"]
_JOBS = _FILLERS["jobs"]
_BACKGROUNDS = _FILLERS["backgrounds"]
_OCCASIONS = _FILLERS["occasions"]
_ANNOUNCEMENTS = _FILLERS["announcements"]
_PLATFORMS = _FILLERS["platforms"]
_FILMS = _FILLERS["films"]
_PLACES = _FILLERS["places"]
_GADGETS = _FILLERS["gadgets"]
_REVIEW_FORMS = _FILLERS["review_forms"]
_PARAGRAPHS = _FILLERS["paragraphs"]
_STYLES = _FILLERS["styles"]
_REWRITE_FORMS = _FILLERS["rewrite_forms"]
_PERSONAS = _FILLERS["personas"]
_QUESTIONS = _FILLERS["questions"]
_ACTS = _FILLERS["acts"]
_MISC_WRITING = _FILLERS["misc_writing"]
_WRITING_EXTRAS = _FILLERS["writing_extras"]


_COVER_FORMS = _FILLERS["cover_forms"]
_SPEECH_FORMS = _FILLERS["speech_forms"]
_SOCIAL_FORMS = _FILLERS["social_forms"]
# a "but" that contrasts: (food, service)
_FOOD_SERVICE = _FILLERS["food_service"]
_STANCES = _FILLERS["stances"]
_ROLEPLAY_FORMS = _FILLERS["roleplay_forms"]
_ACT_FORMS = _FILLERS["act_forms"]


def _writing_prompt(rng: random.Random) -> str:
    tone, length, audience = rng.choice(_TONES), rng.choice(_LENGTHS), rng.choice(_AUDIENCES)
    kind = rng.random()
    if kind < 0.17:
        genre = rng.choice(_GENRES)
        text = rng.choice(_STORY_FORMS).format(a_genre=_a(genre + " ") if genre else "a ", topic=rng.choice(_STORY_TOPICS),
                                               twist=rng.choice(_STORY_TWISTS), tone=tone, a_tone=_a(tone), length=length,
                                               audience=audience)
    elif kind < 0.32:
        text = rng.choice(_POEM_FORMS).format(a_type=_a(rng.choice(_POEM_TYPES)), subject=rng.choice(_POEM_SUBJECTS),
                                              a_tone=_a(tone), word=rng.choice(_ACROSTICS))
    elif kind < 0.39:
        text = rng.choice(_ESSAY_FORMS).format(i=rng.choice(_ISSUES), length=length)
    elif kind < 0.47:
        text = rng.choice(_PRODUCT_FORMS).format(p=rng.choice(_PRODUCTS), audience=audience, length=length)
    elif kind < 0.57:
        recipient = rng.choice(list(_EMAILS))
        text = rng.choice(_EMAIL_FORMS).format(r=recipient, p=rng.choice(_EMAILS[recipient]), tone=tone, length=length)
    elif kind < 0.61:
        job = rng.choice(_JOBS)
        text = rng.choice(_COVER_FORMS).format(job=job, a_job=_a(job), bg=rng.choice(_BACKGROUNDS))
    elif kind < 0.66:
        text = rng.choice(_SPEECH_FORMS).format(o=rng.choice(_OCCASIONS), length=length, tone=tone)
    elif kind < 0.71:
        text = rng.choice(_SOCIAL_FORMS).format(pl=rng.choice(_PLATFORMS), a=rng.choice(_ANNOUNCEMENTS))
    elif kind < 0.78:
        (title, genre, premise), stance, (food, service) = rng.choice(_FILMS), rng.choice(_STANCES), rng.choice(_FOOD_SERVICE)
        text = rng.choice(_REVIEW_FORMS).format(a_stance=_a(stance), stance=stance, title=title, a_genre=_a(genre),
                                                premise=premise, place=rng.choice(_PLACES), gadget=rng.choice(_GADGETS),
                                                stars=rng.randint(1, 5), length=length, food=food, service=service)
    elif kind < 0.85:
        text = rng.choice(_REWRITE_FORMS).format(style=rng.choice(_STYLES), p=rng.choice(_PARAGRAPHS))
    elif kind < 0.92:
        question = rng.choice(_QUESTIONS)
        text = rng.choice(_ROLEPLAY_FORMS).format(p=rng.choice(_PERSONAS), q=question, Q=question[0].upper() + question[1:])
    elif kind < 0.97:
        role = rng.choice(list(_ACTS))
        request = rng.choice(_ACTS[role]).format(d=rng.choice(_DESTINATIONS), job=rng.choice(_JOBS), i=rng.choice(_ISSUES))
        text = rng.choice(_ACT_FORMS).format(r=_a(role), role=role, q=request)
    else:
        text = rng.choice(_MISC_WRITING)
    # the extras suit stories and poems only
    return text + (rng.choice(_WRITING_EXTRAS) if kind < 0.32 else "")


# ---- knowledge: explanations, and extraction over a passage the prompt contains ----

# singular noun phrases across the sciences, technology, society and the arts
_TOPICS = _FILLERS["topics"]
_TOPIC_FORMS = _FILLERS["topic_forms"]
_HOW_WHY = _FILLERS["how_why"]
_HOW_WHY_FORMS = _FILLERS["how_why_forms"]
_PAIRS = _FILLERS["pairs"]
_PAIR_FORMS = _FILLERS["pair_forms"]
_DEBATES = _FILLERS["debates"]
_DEBATE_FORMS = _FILLERS["debate_forms"]
_EVENTS = _FILLERS["events"]
_EVENT_FORMS = _FILLERS["event_forms"]
_PHENOMENA = _FILLERS["phenomena"]
_PHENOMENON_FORMS = _FILLERS["phenomenon_forms"]
_FIGURES = _FILLERS["figures"]
_FIGURE_FORMS = _FILLERS["figure_forms"]
_REGIONS = _FILLERS["regions"]
_REGION_FORMS = _FILLERS["region_forms"]
_KNOWLEDGE_EXTRAS = _FILLERS["knowledge_extras"]

_COMPANIES = _FILLERS["companies"]
_CITIES = _FILLERS["cities"]
_MONTHS = _FILLERS["months"]
_GOOD_DRIVERS = _FILLERS["good_drivers"]
_BAD_DRIVERS = _FILLERS["bad_drivers"]
# (what happened, a detail with {n}, what comes next, range of n)
_NEWS = _FILLERS["news"]
_ROLES = _FILLERS["roles"]
_STORE = _FILLERS["store"]
_TITLES = _FILLERS["titles"]
_BOOK_GENRES = _FILLERS["book_genres"]
_PREMISES = _FILLERS["premises"]
# mood-labelled lines, generic enough for any product or place
_REVIEW_SNIPPETS = _FILLERS["review_snippets"]
_PROJECTS = _FILLERS["projects"]
_NOTE_TASKS = _FILLERS["note_tasks"]


_PERIODS = _FILLERS["periods"]
_REVIEWED = _FILLERS["reviewed"]


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(2019, 2026)}"


# Passage helpers: each returns (what it is, the invented passage, tasks specific to it).
def _p_company(rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    co, (city, city2), ceo = rng.choice(_COMPANIES), rng.sample(_CITIES, 2), _person(rng)
    rev, pct, up = rng.randint(12, 980), rng.randint(2, 35), rng.random() < 0.65
    period = f"{rng.choice(_PERIODS)} {rng.randint(2018, 2025)}"
    extra = [f"Chief executive {ceo} {'credited' if up else 'blamed'} {rng.choice(_GOOD_DRIVERS if up else _BAD_DRIVERS)}.",
             f"The company employs {rng.randint(80, 25000):,} people and plans to open a new "
             f"{rng.choice(('factory', 'office', 'warehouse', 'research centre'))} in {city2} in {rng.choice(_MONTHS)}.",
             f"Its {rng.choice(('online', 'wholesale', 'services', 'international'))} business accounted for "
             f"{rng.randint(10, 60)}% of sales.",
             f"Net profit {'rose' if up else 'fell'} to ${rng.randint(1, rev // 4 + 1)} million."]
    text = (f"{co}, based in {city}, reported revenue of ${rev} million for {period}, {'up' if up else 'down'} {pct}% "
            f"from a year earlier. " + " ".join(rng.sample(extra, rng.randint(2, 4))))
    return "company report", text, (f"What was {co}'s revenue, and how did it change?",
                                    "Return a JSON object with the keys company, city, revenue_millions, change_percent and ceo.",
                                    "Is this report good news or bad news for the company? Explain briefly.")


def _p_news(rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    event, detail, after, (lo, hi) = rng.choice(_NEWS)
    city, person, weekday = rng.choice(_CITIES), _person(rng), rng.choice(_WEEKDAYS)
    text = (f"On {weekday}, {_date(rng)}, {event} in {city}. According to {rng.choice(_ROLES)}, {person}, "
            f"{detail.format(n=rng.randint(lo, hi))}. Officials added that {after}.")
    return "news item", text, ("Who, what, where and when? Answer in four short lines.",
                               "Return the location, date and key number as JSON.", "Write a headline for this news item.")


def _p_products(rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    rows = [(name, cat, rng.randint(9, 300) - 0.01, rng.randint(25, 50) / 10)
            for name, cat in rng.sample(_STORE, rng.randint(3, 5))]
    if rng.random() < 0.5:
        text = "\n".join(f"- {n} ({c}): ${p:.2f}, rated {r}/5" for n, c, p, r in rows)
    else:
        text = " ".join(f"The {n} costs ${p:.2f} and is rated {r} out of 5." for n, _, p, r in rows)
    return "product list", text, ("Sort the products by price, cheapest first.", "Which product has the highest rating?",
                                  "Return the products as a JSON array with name, price and rating.",
                                  "Put the products in a Markdown table.",
                                  f"Which products cost less than ${rng.randint(50, 150)}?")


def _p_books(rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    books = [(t, _person(rng), rng.randint(1950, 2024), rng.choice(_BOOK_GENRES), rng.choice(_PREMISES))
             for t in rng.sample(_TITLES, rng.randint(2, 4))]
    text = " ".join(f"{t} by {a} ({y}) is {_a(g)} about {p}." for t, a, y, g, p in books)
    return "set of book descriptions", text, ("Sort the books by publication year.",
                                              "Which book would you recommend to someone who likes true stories, and why?")


def _p_table(rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    table = rng.randrange(3)
    if table == 0:
        head = "Name | Department | Start year | Salary"
        rows = [f"{_person(rng)} | {rng.choice(('Sales', 'IT', 'HR', 'Finance'))} | {rng.randint(2008, 2024)} | "
                f"{rng.randint(30, 120) * 1000}" for _ in range(rng.randint(3, 5))]
    elif table == 1:
        head, highs = "Day | High (°C) | Low (°C) | Rain (mm)", [rng.randint(8, 32) for _ in range(5)]
        rows = [f"{day} | {hi} | {hi - rng.randint(4, 12)} | {rng.choice((0, 0, 1, 3, 7, 12))}"
                for day, hi in zip(("Mon", "Tue", "Wed", "Thu", "Fri"), highs)]
    else:
        head = "Student | Maths | Science | English"
        rows = [f"{n} | {rng.randint(40, 100)} | {rng.randint(40, 100)} | {rng.randint(40, 100)}"
                for n in rng.sample(_FIRST, rng.randint(3, 5))]
    col = head.split(" | ")[rng.randint(1, 3)]
    return "table", head + "\n" + "\n".join(rows), (f"Which row has the highest {col}?", "Convert the table to JSON.",
                                                    f"Sort the rows by {col}, highest first.", f"What is the average {col}?")


def _p_reviews(rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    text = "\n".join(f"Review {i + 1}: {line}" for i, line in enumerate(rng.sample(_REVIEW_SNIPPETS, rng.randint(3, 5))))
    return f"set of customer reviews of {_a(rng.choice(_REVIEWED))}", text, (
        "Classify each review as positive, negative or mixed, and return the result as JSON.",
        "What are the main complaints, if any?")


def _p_notes(rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    (p1, p2), (t1, t2) = (_person(rng), _person(rng)), rng.sample(_NOTE_TASKS, 2)
    text = (f"Notes from the {rng.choice(_PROJECTS)} meeting: the launch moves to {_date(rng)}. {p1} will {t1} by "
            f"{rng.choice(_MONTHS)} {rng.randint(1, 28)}. {p2} is responsible for making sure we {t2}. "
            f"The budget is capped at ${rng.randint(5, 90) * 1000:,}.")
    return "set of meeting notes", text, ("List the action items with their owner and deadline as a JSON list.",
                                          f"What is {p2.split()[0]} responsible for?",
                                          "Write a one-sentence summary of the decisions.")


_PASSAGES = (_p_company, _p_news, _p_products, _p_books, _p_table, _p_reviews, _p_notes)
_PROSE = _FILLERS["prose"]
_EXTRACT_TASKS = _FILLERS["extract_tasks"]
_EXTRACT_FORMS = _FILLERS["extract_forms"]


def _knowledge_prompt(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.32:
        what, text, own = rng.choice(_PASSAGES)(rng)
        # the generic tasks (summarise, entities, dates) suit prose, not tables and lists
        task = rng.choice(_EXTRACT_TASKS if what in _PROSE and rng.random() < 0.35 else own)
        return rng.choice(_EXTRACT_FORMS).format(task=task, task_lc=task[0].lower() + task[1:], kind=what, text=text)
    if kind < 0.52:
        text = rng.choice(_TOPIC_FORMS).format(t=rng.choice(_TOPICS))
    elif kind < 0.66:
        text = rng.choice(_HOW_WHY_FORMS).format(h=rng.choice(_HOW_WHY))
    elif kind < 0.75:
        a, b = rng.sample(rng.choice(_PAIRS), 2)
        text = rng.choice(_PAIR_FORMS).format(a=a, b=b, A=a[0].upper() + a[1:])
    elif kind < 0.82:
        text = rng.choice(_DEBATE_FORMS).format(d=rng.choice(_DEBATES))
    elif kind < 0.89:
        text = rng.choice(_EVENT_FORMS).format(e=rng.choice(_EVENTS))
    elif kind < 0.92:
        text = rng.choice(_PHENOMENON_FORMS).format(p=rng.choice(_PHENOMENA))
    elif kind < 0.96:
        text = rng.choice(_FIGURE_FORMS).format(f=rng.choice(_FIGURES))
    else:
        text = rng.choice(_REGION_FORMS).format(r=rng.choice(_REGIONS))
    return text + rng.choice(_KNOWLEDGE_EXTRAS)


# Three disjoint prompt sets: the experts train on one, the classifier fits another, the constants are tuned on the third
TRAINING_SEED, CLASSIFIER_SEED, TUNING_SEED = 0, 1, 2
HELD_OUT_FROM = 8000  # training prompts per domain held out of the tuning set: more than any expert used

DOMAINS = {"code": _code_prompt, "math": _math_prompt, "writing": _writing_prompt, "knowledge": _knowledge_prompt}


def domain_prompts(domain: str, count: int, seed: int = TRAINING_SEED) -> list[Prompt]:
    """``count`` distinct templated prompts of one domain (fewer if the templates run out). A prompt that
    overlaps MT-Bench (``specmesh.distill.overlap``) is dropped and another drawn in its place."""
    if domain not in DOMAINS:
        raise InvalidArgument("domain", f"unknown domain {domain!r}; templated domains: {', '.join(DOMAINS)}")
    make, rng = DOMAINS[domain], random.Random(f"{domain}-{seed}")
    seen: dict[str, None] = {}
    dropped: set[str] = set()
    for _ in range(count * 20):
        if len(seen) >= count:
            break
        text = make(rng)
        if text in seen or text in dropped:
            continue
        if overlaps(text):
            dropped.add(text)
        else:
            seen[text] = None
    return [Prompt(text, domain) for text in seen]


def classifier_examples(per_domain: int = 400, seed: int = CLASSIFIER_SEED) -> list[dict[str, str]]:
    """The request classifier's labelled examples: ``per_domain`` templated prompts of every domain
    (another seed than the experts' training prompts)."""
    return [{"text": p.text, "kind": d} for d in DOMAINS for p in domain_prompts(d, per_domain, seed=seed)]


def tuning_prompts(per_domain: int = 4, seed: int = TUNING_SEED) -> list[Prompt]:
    """Prompts to tune the speculation constants on, ``per_domain`` of every domain: another seed than the
    experts' training prompts and the classifier's examples, and none of either's texts (the bench judges
    on MT-Bench; these never overlap it either)."""
    seen = {p.text for d in DOMAINS for p in domain_prompts(d, HELD_OUT_FROM, seed=TRAINING_SEED)}
    seen |= {e["text"] for e in classifier_examples()}
    chosen = []
    for domain in DOMAINS:
        drawn = 2 * per_domain  # a longer draw of the same seed starts with the shorter one
        while len(fresh := [p for p in domain_prompts(domain, drawn, seed=seed) if p.text not in seen]) < per_domain:
            drawn *= 2
        chosen.extend(fresh[:per_domain])
    return chosen


def write_tuning_prompts(path: str | Path) -> None:
    lines = (json.dumps({"prompt": p.text, "category": p.category}, ensure_ascii=False) for p in tuning_prompts())
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def write_classifier_examples(path: str | Path) -> None:
    lines = (json.dumps(e, ensure_ascii=False) for e in classifier_examples())
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
