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


def _a(phrase: str) -> str:
    return ("an " if phrase[:1].lower() in "aeiou" else "a ") + phrase


def _money(x: float) -> str:
    return f"${x:,.0f}" if x == int(x) else f"${x:,.2f}"


_FIRST = ("Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam", "Maya",
          "Nikos", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Yuki", "Zane", "Priya")
_MEN = ("Adam", "Carlos", "Daniel", "Ethan", "Felix", "George", "Hassan", "Ivan", "Jon", "Kofi", "Luca", "Marco", "Omar")
_WOMEN = ("Anna", "Bella", "Chloe", "Diana", "Elena", "Fatima", "Hana", "Irene", "Julia", "Lena", "Mira", "Nora", "Sofia")
_SURNAMES = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Alvarez", "Kowalski", "Brennan", "Haddad", "Novak", "Castillo",
             "Whitlock", "Sato", "Fischer", "Mensah", "Rossi", "Petrov", "Nakamura", "Duarte", "Abbott", "Iyer")

_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST + _MEN + _WOMEN)} {rng.choice(_SURNAMES)}"


# ---- code ----

_LANGS = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "C#", "Go", "Rust", "Ruby", "Kotlin", "Swift",
          "PHP", "Scala", "Haskell", "Lua", "R", "Julia")
_OO_LANGS = ("Python", "JavaScript", "TypeScript", "Java", "C++", "C#", "Go", "Rust", "Ruby", "Kotlin", "Swift", "PHP")
_FENCE = {"C++": "cpp", "C#": "csharp"}
_FUNCTION_TASKS = ("reverses a singly linked list", "checks whether a number is prime",
                   "merges two sorted lists into one sorted list", "counts how often each word appears in a text",
                   "computes n factorial", "finds the longest common prefix of a list of strings",
                   "removes duplicates from a list while keeping the original order", "converts a Roman numeral to an integer",
                   "converts an integer to a Roman numeral", "checks whether an email address looks valid",
                   "flattens an arbitrarily nested list",
                   "finds the contiguous subarray with the largest sum", "performs binary search on a sorted array",
                   "splits a CSV line into fields, respecting quoted commas", "transposes a matrix",
                   "checks whether the brackets in a string are balanced", "computes the greatest common divisor of two integers",
                   "sorts a list of people by last name and then by age", "returns the k most frequent elements of an array",
                   "rotates an array to the right by k positions", "finds the second largest distinct value in an array",
                   "checks whether two strings are anagrams", "finds the first non-repeating character in a string",
                   "computes the Levenshtein distance between two strings", "generates all permutations of a string",
                   "generates all subsets of a set", "returns all primes below n using a sieve",
                   "converts a decimal number to binary", "parses a date such as 2024-03-15 and returns the weekday",
                   "keeps a running average of a stream of numbers",
                   "merges overlapping intervals", "checks whether a binary tree is a valid binary search tree",
                   "computes the height of a binary tree",
                   "finds the shortest path in an unweighted graph", "detects a cycle in a directed graph",
                   "orders tasks so that every task comes after its dependencies", "counts the islands in a grid of 0s and 1s",
                   "finds the longest increasing subsequence", "solves the 0/1 knapsack problem",
                   "counts the ways to climb n stairs taking one or two steps at a time",
                   "finds two numbers in an array that add up to a target", "groups a list of words into sets of anagrams",
                   "compresses a string like aaabcc into a3b1c2", "validates a filled-in Sudoku board",
                   "checks whether a year is a leap year", "converts temperatures between Celsius and Fahrenheit",
                   "formats a number of seconds as hours, minutes and seconds",
                   "capitalizes the first letter of every word in a sentence", "counts the vowels and consonants in a string",
                   "reverses the order of the words in a sentence",
                   "checks whether a string is a palindrome, ignoring case and punctuation",
                   "splits a list into chunks of size n", "deep-merges two nested dictionaries",
                   "retries a failing function call with exponential backoff", "memoizes an expensive function",
                   "multiplies two matrices", "prints Pascal's triangle up to n rows", "finds the mode of a list of numbers",
                   "computes the standard deviation of a list of numbers",
                   "shuffles an array in place with the Fisher-Yates algorithm", "checks whether a number is an Armstrong number",
                   "finds the longest palindromic substring", "counts the set bits in an integer",
                   "converts snake_case identifiers to camelCase", "truncates a long string to n characters and adds an ellipsis",
                   "checks that a password has at least eight characters, a digit and an uppercase letter",
                   "finds the missing number in an array of 1 to n",
                   "computes the Hamming distance between two equal-length strings",
                   "evaluates an expression in reverse Polish notation", "generates a random password of a given length",
                   "checks whether one string is a rotation of another",
                   "splits a restaurant bill, including tip, between n people", "returns the day of the year for a given date",
                   "rounds a price to the nearest 0.05", "parses a URL query string into a dictionary",
                   "finds all files with a given extension in a directory tree",
                   "counts the lines, words and characters in a file")
_CLASS_TASKS = ("a Stack class with push, pop, peek and is_empty", "a BankAccount class whose balance can never go negative",
                "an LRU cache with get and put in O(1) time", "a queue built from two stacks",
                "a min-heap with insert and extract_min", "a Matrix class that supports addition and multiplication",
                "a Trie with insert, search and starts_with", "a small event emitter with on, off and emit",
                "a rate limiter that allows at most N calls per minute",
                "a ShoppingCart class that adds and removes items and computes the total with tax",
                "a Library class that tracks which books are borrowed and by whom",
                "a Fraction class that keeps fractions in lowest terms", "a Vector2D class with addition, scaling and length",
                "a doubly linked list with insert, delete and reverse", "a thread-safe counter",
                "a Graph class with add_edge and a depth-first traversal", "a state machine for a traffic light",
                "a TodoList class that lists tasks by due date", "a ParkingLot class that assigns the nearest free spot",
                "a fixed-size circular buffer", "a key-value store whose keys expire after a timeout",
                "a Deck of cards with shuffle and deal",
                "a hash map with separate chaining, without using the built-in dictionary",
                "a priority queue of tasks ordered by priority and arrival time")
_PROGRAM_TASKS = ("a command-line to-do list that saves tasks to a JSON file", "a number-guessing game between 1 and 100",
                  "a script that renames all .jpg files in a folder by their date",
                  "a program that prints the ten most common IP addresses in a log file",
                  "a two-player tic-tac-toe game in the terminal", "a calculator that evaluates expressions typed by the user",
                  "a program that reads a CSV of sales and prints the total per month",
                  "a unit converter for lengths and weights",
                  "a program that checks which websites in a list are reachable",
                  "a script that backs up a folder into a timestamped zip archive",
                  "a tiny HTTP server that returns the current time as JSON",
                  "a simulation that rolls two dice 10,000 times and prints the distribution of sums",
                  "a tool that finds duplicate files by hash", "a program that prints a calendar for a given month",
                  "a hangman game", "a converter from a Markdown list to an HTML list",
                  "a quiz that asks five questions and keeps score", "a program that prints a multiplication table up to 12 x 12",
                  "a script that merges several CSV files with the same columns",
                  "a password strength checker that gives feedback",
                  "an ATM simulation with deposits, withdrawals and a PIN check")
_CODE_CONSTRAINTS = (
    "", "", "", "", " without using any built-in sorting functions", " in O(n) time", " using recursion", " without recursion",
    " with comments explaining each step", ", handling empty input and other edge cases", " using only the standard library",
    " in a functional style", " with O(1) extra space", " and include a few example calls", " and explain its time complexity",
    " with input validation and clear error messages", " in fewer than 15 lines", ", easy for a beginner to read",
    " with descriptive variable names", " and write tests for it", ", fast enough for very large inputs", " without using loops",
)
_STYLE_CONSTRAINTS = ("", "", " with comments explaining each step", " using only the standard library",
                      " and include a few example calls", " with input validation and clear error messages",
                      ", easy for a beginner to read", " and write tests for it")
_PY_EXTRAS = (" with type hints", " with a docstring and doctests", " using a generator", " as a dataclass-friendly module")
_FUNCTION_FORMS = ("Write a {lang} function that {task}{cons}.", "Can you write a function in {lang} that {task}{cons}?",
                   "I need a {lang} function that {task}{cons}. Please explain how it works.",
                   "Implement a function that {task} in {lang}{cons}.", "Show me how to write {lang} code that {task}{cons}.",
                   "How do I write a function that {task} in {lang}?",
                   "Give me an efficient {lang} solution for a function that {task}{cons}.",
                   "In {lang}, write a function that {task}{cons}. Then walk through an example input.",
                   "Write a function that {task}{cons}. Use {lang}.",
                   "For a coding interview, write a {lang} function that {task}, and discuss its complexity.",
                   "Write pseudocode and then a {lang} implementation of a function that {task}.",
                   "Write a {lang} function that {task}. Which edge cases should it handle?",
                   "Write unit tests in {lang} for a function that {task}.",
                   "What is the most efficient way to write a function that {task}? Implement it in {lang}.",
                   "Develop a {lang} program that {task}{cons}.")
_CLASS_FORMS = ("Design and implement {task} in {lang}{cons}.", "Write {task} in {lang}{cons}.",
                "Implement {task} in {lang} and show a short usage example.",
                "How would you design {task}? Show the {lang} code.", "Create {task} in {lang}, with unit tests.")
_PROGRAM_FORMS = ("Write {task} in {lang}{cons}.", "Build {task} using {lang}.", "Can you help me write {task} in {lang}?",
                  "Develop {task} in {lang}. Keep the code well organised into functions.",
                  "I want to learn {lang} by building {task}. Walk me through it step by step.")
# (language, what it should do, what goes wrong, code with the bug)
_BUGGY = (("Python", "return the largest value in a list", "it misses the last element",
           "def find_max(values):\n    best = values[0]\n    for i in range(1, len(values) - 1):\n"
           "        if values[i] > best:\n            best = values[i]\n    return best"),
          ("Python", "start a fresh list on every call unless one is passed in", "items from earlier calls keep showing up",
           "def add_item(item, items=[]):\n    items.append(item)\n    return items"),
          ("Python", "check whether a string is a palindrome", "it raises an AttributeError",
           "def is_palindrome(s):\n    s = s.lower()\n    return s == s.reverse()"),
          ("Python", "compute n factorial", "it always returns 0",
           "def factorial(n):\n    if n == 0:\n        return 0\n    return n * factorial(n - 1)"),
          ("Python", "count how often each word occurs", "it raises a KeyError",
           "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] += 1\n"
           "    return counts"),
          ("Python", "find the index where a target should be inserted in a sorted list", "it never finishes for some inputs",
           "def insert_position(arr, target):\n    lo, hi = 0, len(arr)\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
           "        if arr[mid] < target:\n            lo = mid\n        else:\n            hi = mid\n    return lo"),
          ("Python", "remove every negative number from a list", "some negative numbers are left behind",
           "def remove_negatives(nums):\n    for n in nums:\n        if n < 0:\n            nums.remove(n)\n    return nums"),
          ("Python", "return the nth Fibonacci number", "the numbers come out wrong",
           "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a = b\n        b = a + b\n    return a"),
          ("Python", "count how many times increment is called", "it raises an UnboundLocalError",
           "class Counter:\n    count = 0\n\n    def increment(self):\n        count += 1"),
          ("JavaScript", "add up the numbers in an array", "it returns NaN",
           "function sumArray(arr) {\n  let total = 0;\n  for (let i = 0; i <= arr.length; i++) {\n    total += arr[i];\n  }\n"
           "  return total;\n}"),
          ("JavaScript", "fetch a user and return their name", "it throws 'response.json is not a function'",
           "async function getUserName(id) {\n  const response = fetch(`/api/users/${id}`);\n"
           "  const data = await response.json();\n  return data.name;\n}"),
          ("JavaScript", "print 0, 1 and 2 after a short delay", "it prints 3 three times",
           "for (var i = 0; i < 3; i++) {\n  setTimeout(function () {\n    console.log(i);\n  }, 100);\n}"),
          ("JavaScript", "print the highest score", "it prints 9 instead of 100",
           "const scores = [10, 9, 100, 25];\nscores.sort();\nconsole.log(scores[scores.length - 1]);"),
          ("C", "return the sum of 1 to n", "it returns garbage values",
           "int sum_to(int n) {\n    int total;\n    for (int i = 1; i <= n; i++)\n        total += i;\n    return total;\n}"),
          ("C", "return a heap copy of a string", "it sometimes crashes",
           "char *copy(const char *s) {\n    char *out = malloc(strlen(s));\n    strcpy(out, s);\n    return out;\n}"),
          ("C++", "remove the even numbers from a vector", "it crashes or skips elements",
           "std::vector<int> v = {1, 2, 3, 4, 6};\nfor (auto it = v.begin(); it != v.end(); ++it) {\n    if (*it % 2 == 0)\n"
           "        v.erase(it);\n}"),
          ("Java", "check whether a user's role is admin", "it returns false even for \"admin\"",
           "public static boolean isAdmin(String role) {\n    if (role == \"admin\") {\n        return true;\n    }\n"
           "    return false;\n}"),
          ("Java", "return the average of an array", "the decimals are lost",
           "public static double average(int[] xs) {\n    int sum = 0;\n    for (int x : xs) sum += x;\n"
           "    return sum / xs.length;\n}"),
          ("Go", "add up the numbers in a slice", "it returns the wrong total",
           "func sum(nums []int) int {\n    total := 0\n    for i := range nums {\n        total += i\n    }\n"
           "    return total\n}"),
          ("Rust", "return the longest word", "it returns the shortest one",
           "fn longest(words: &[String]) -> &String {\n    let mut best = &words[0];\n    for w in words {\n"
           "        if w.len() < best.len() {\n            best = w;\n        }\n    }\n    best\n}"),
          ("SQL", "list departments whose average salary is above 50000", "the database rejects the query",
           "SELECT department, AVG(salary)\nFROM employees\nWHERE AVG(salary) > 50000\nGROUP BY department;"),
          ("Bash", "print a message when notes.txt is among the text files", "it fails with a syntax error",
           "for f in *.txt; do\n  if [ \"$f\" == \"notes.txt\" ]\n    echo \"found notes\"\n  fi\ndone"),
          ("TypeScript", "return the length of an optional string", "the compiler reports an error",
           "function getLength(value: string | null): number {\n  return value.length;\n}"))
_BUG_FORMS = (
    "Find and fix the bug in this {lang} code. It should {purpose}.\n\n{code}",
    "This {lang} snippet is supposed to {purpose}, but {symptom}. What's wrong?\n\n{code}",
    "Why does this code misbehave? It should {purpose}.\n\n{code}",
    "Debug the following {lang} code and explain the fix:\n\n{code}",
    "My code should {purpose}, but {symptom}. Can you help?\n\n{code}",
    "{code}\n\nThe function above is meant to {purpose}. Point out the mistake and give a corrected version.",
    "Can you spot the bug? Right now {symptom}.\n\n{code}",
)
_SNIPPETS = (("Python",
              "def mystery(s):\n    seen = set()\n    out = []\n    for ch in s:\n        if ch not in seen:\n"
              "            seen.add(ch)\n            out.append(ch)\n    return \"\".join(out)"),
             ("Python", "result = [x * x for x in range(10) if x % 3 == 0]\nprint(result)"),
             ("Python", "def f(n):\n    if n < 2:\n        return n\n    return f(n - 1) + f(n - 2)"),
             ("Python",
              "from collections import Counter\n\ndef top_words(text, k):\n    words = text.lower().split()\n"
              "    return [w for w, _ in Counter(words).most_common(k)]"),
             ("Python",
              "def pairs(nums, target):\n    found = []\n    for i in range(len(nums)):\n"
              "        for j in range(i + 1, len(nums)):\n            if nums[i] + nums[j] == target:\n"
              "                found.append((nums[i], nums[j]))\n    return found"),
             ("Python",
              "data = {\"b\": 2, \"a\": 3, \"c\": 1}\nfor key, value in sorted(data.items(), key=lambda kv: kv[1]):\n"
              "    print(key, value)"),
             ("Python",
              "def search(matrix, target):\n    row, col = 0, len(matrix[0]) - 1\n    while row < len(matrix) and col >= 0:\n"
              "        if matrix[row][col] == target:\n            return True\n        if matrix[row][col] > target:\n"
              "            col -= 1\n        else:\n            row += 1\n    return False"),
             ("Python",
              "import time\n\ndef timed(func):\n    def wrapper(*args, **kwargs):\n        start = time.perf_counter()\n"
              "        result = func(*args, **kwargs)\n"
              "        print(f\"{func.__name__} took {time.perf_counter() - start:.3f}s\")\n        return result\n"
              "    return wrapper"),
             ("JavaScript",
              "const debounce = (fn, ms) => {\n  let timer;\n  return (...args) => {\n    clearTimeout(timer);\n"
              "    timer = setTimeout(() => fn(...args), ms);\n  };\n};"),
             ("JavaScript",
              "const totals = orders\n  .filter(o => o.status === \"paid\")\n  .reduce((acc, o) => {\n"
              "    acc[o.customer] = (acc[o.customer] || 0) + o.amount;\n    return acc;\n  }, {});"),
             ("C",
              "int count(unsigned int x) {\n    int c = 0;\n    while (x) {\n        x &= x - 1;\n        c++;\n    }\n"
              "    return c;\n}"),
             ("Java",
              "public static int[] prefixSums(int[] a) {\n    int[] out = new int[a.length + 1];\n"
              "    for (int i = 0; i < a.length; i++) {\n        out[i + 1] = out[i] + a[i];\n    }\n    return out;\n}"),
             ("Go",
              "func worker(jobs <-chan int, results chan<- int) {\n    for j := range jobs {\n        results <- j * 2\n    }\n"
              "}"),
             ("Rust", "fn word_lengths(text: &str) -> Vec<usize> {\n    text.split_whitespace().map(|w| w.len()).collect()\n}"),
             ("SQL",
              "SELECT c.name, COUNT(o.id) AS orders\nFROM customers c\nLEFT JOIN orders o ON o.customer_id = c.id\n"
              "GROUP BY c.name\nORDER BY orders DESC\nLIMIT 5;"), ("Bash", "find . -name \"*.log\" -mtime +7 -exec gzip {} \\;"),
             ("C++", "std::map<std::string, int> freq;\nfor (const auto& w : words) {\n    ++freq[w];\n}"),
             ("TypeScript",
              "interface User { id: number; name: string; active: boolean }\n\n"
              "function activeNames(users: User[]): string[] {\n  return users.filter(u => u.active).map(u => u.name).sort();\n"
              "}"))
_FN_NAMES = ("process", "compute", "summarise", "helper", "calc", "transform", "check", "f")
_SEQ_NAMES = (("scores", "score"), ("prices", "price"), ("values", "value"), ("temps", "t"), ("ages", "age"), ("nums", "n"))
_RECORDS = (("products", "p", "price", "stock"), ("users", "u", "age", "score"), ("orders", "o", "total", "items"),
            ("rooms", "r", "size", "beds"))


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


_SNIPPET_FORMS = (
    "What does this {lang} code do?\n\n{code}", "Explain this {lang} snippet line by line:\n\n{code}",
    "What is the time and space complexity of the following code?\n\n{code}",
    "Refactor this {lang} code to make it more readable:\n\n{code}", "Write unit tests for this {lang} code:\n\n{code}",
    "Translate this {lang} code into {other}:\n\n{code}", "Add comments and documentation to this code:\n\n{code}",
    "Can this code be made faster or simpler? Explain.\n\n{code}",
    "{code}\n\nWalk through what this does on a small example input.", "Review this code as if it were a pull request:\n\n{code}",
)
# (schema as words, questions over it)
_SCHEMAS = (
    ("employees(id, name, department_id, salary, hire_date) and departments(id, name, city)",
     ("the highest-paid employee in each department", "the number of employees hired each year",
      "departments whose average salary is above 60,000", "employees who earn more than their department's average",
      "the department with the most employees")),
    ("orders(id, customer_id, order_date, total) and customers(id, name, country)",
     ("the total revenue per country", "customers who have never placed an order", "the five customers who spent the most",
      "the number of orders per month in 2023", "the average order value of each customer")),
    ("students(id, name, year), courses(id, title, credits) and enrollments(student_id, course_id, grade)",
     ("each student's average grade", "courses with no enrolled students", "the top three students by average grade",
      "the number of students in each course", "students taking more than four courses")),
    ("books(id, title, author_id, published_year, price) and authors(id, name, country)",
     ("authors with more than three books", "the most expensive book by each author", "books published before 1950, oldest first",
      "the average book price per author country")),
    ("products(id, name, category, price, stock)",
     ("products that are out of stock", "the number of products and the average price per category",
      "the three most expensive products in each category", "products priced between 10 and 50")),
    ("rides(id, driver_id, started_at, distance_km, fare) and drivers(id, name, city)",
     ("the total fares earned by each driver last month", "the longest ride in each city", "drivers who completed no rides",
      "the average fare per kilometre in each city")),
    ("page_visits(user_id, page, visited_at)",
     ("the number of unique users per day", "the most visited page", "users who visited on three consecutive days",
      "each user's first and last visit")),
)
_SQL_FORMS = ("Given the tables {schema}, write a SQL query that returns {q}.",
              "Write a SQL query to find {q}. The database has {schema}.",
              "I have a database with {schema}. How do I get {q}?",
              "Using {schema}, write a {dialect} query for {q} and explain how it works.",
              "Tables: {schema}. Query: {q}. Please write it in {dialect}.")
_PAGES = ("a personal portfolio page with a header, an about section and a contact form",
          "a login form with client-side validation", "a responsive three-column pricing table", "a restaurant menu page",
          "a photo gallery laid out as a grid", "a navigation bar that collapses into a hamburger menu on small screens",
          "a countdown timer to New Year's Day", "a to-do list where items can be added and removed",
          "a landing page for a mobile app", "an FAQ section with collapsible answers",
          "a profile card with an avatar, a name and a short bio", "a dark-mode toggle",
          "a table of books that sorts when a column header is clicked", "a modal dialog that opens when a button is clicked",
          "a signup form with a password strength meter", "a simple image carousel")
_PAGE_FORMS = ("Create {page} using HTML and CSS.", "Write the HTML, CSS and JavaScript for {page}.",
               "Build {page} with plain HTML and CSS, no frameworks.", "How do I make {page}? Show the code.",
               "Write a React component for {page}.", "Using Flexbox or Grid, create {page}.")
_REGEXES = ("matches a five-digit ZIP code", "extracts every email address from a text", "matches dates in the format YYYY-MM-DD",
            "validates a 24-hour time such as 23:59", "finds all hashtags in a social media post",
            "matches hex colour codes like #1a2B3c", "extracts the domain name from a URL",
            "matches phone numbers like (555) 123-4567", "finds repeated words such as 'the the'", "matches IPv4 addresses",
            "strips HTML tags from a string", "matches words that start with a capital letter",
            "captures the key and value in lines like key=value", "matches signed floating-point numbers",
            "finds all five-letter words")
_REGEX_FORMS = ("Write a regular expression that {r}.", "Give me a regex that {r}, and explain each part.",
                "In {lang}, use a regular expression that {r}.",
                "How would I write a regex that {r}? Include strings that should and should not match.")
_SHELL_TASKS = ("count the lines in all .py files under the current directory", "find the ten largest files in a directory tree",
                "replace 'foo' with 'bar' in every .txt file", "list the processes using the most memory",
                "print the lines that are in a.txt but not in b.txt", "rename every .jpeg file to .jpg",
                "delete files older than 30 days in a cache folder",
                "print the unique values of the second column of a CSV file",
                "follow a log file and show only lines containing ERROR",
                "archive a project folder as tar.gz without node_modules",
                "count how often each HTTP status code appears in an access log", "find all files modified in the last 24 hours",
                "see which ports are listening", "add up the size of all .mp4 files", "find duplicate lines in a file")
_SHELL_FORMS = ("Write a Bash one-liner to {s}.", "What shell command would I use to {s}?",
                "How can I {s} from the Linux command line?", "Write a short shell script to {s}, and explain each part.",
                "On macOS, how do I {s} in the terminal?")
_CONCEPTS = (
    "recursion", "closures", "hash tables", "big-O notation", "garbage collection", "race conditions", "deadlocks",
    "dependency injection", "REST APIs", "SQL joins", "database indexes", "git rebase", "mocking in unit tests",
    "binary search trees", "dynamic programming", "composition over inheritance", "exception handling", "list comprehensions",
    "async/await", "memory leaks", "pointers", "ownership and borrowing", "generics", "interfaces", "immutability",
    "pure functions", "higher-order functions", "the event loop", "mutexes", "caching", "pagination", "the SOLID principles",
    "the observer pattern", "the singleton pattern", "decorators", "iterators", "virtual functions", "stack versus heap memory",
    "tail recursion", "bit manipulation", "password hashing with salts", "CORS", "JSON serialization", "the MVC architecture",
    "floating-point rounding errors", "Unicode and character encodings", "continuous integration", "lazy evaluation",
)
_CONCEPT_FORMS = ("Explain {c} with a short {lang} example.",
                  "What should every beginner know about {c}? Use {lang} for the examples.",
                  "Give me a simple {lang} example that demonstrates {c}.",
                  "What are common mistakes people make with {c} in {lang}?",
                  "I keep getting confused by {c}. Can you explain the idea with code?",
                  "When should I care about {c}? Give a practical {lang} example.",
                  "Write a short tutorial on {c} in {lang}, with two exercises.",
                  "Explain {c} in simple terms and show what that looks like in {lang}.")
_ALGORITHMS = (
    "Dijkstra's algorithm", "quicksort", "merge sort", "heap sort", "binary search", "breadth-first search", "depth-first search",
    "A* search", "Kruskal's algorithm", "union-find", "the two-pointer technique", "the sliding-window technique",
    "Kadane's algorithm", "topological sorting", "a trie", "a skip list", "a Bloom filter", "consistent hashing",
    "the KMP string-matching algorithm", "backtracking", "the Floyd-Warshall algorithm", "reservoir sampling", "counting sort",
    "a segment tree", "a red-black tree", "the Bellman-Ford algorithm",
)
_ALGORITHM_FORMS = ("Explain how {a} works and implement it in {lang}.", "What is the time complexity of {a}, and why?",
                    "Implement {a} in {lang}{cons}.", "When would you use {a}? Give an example problem and a {lang} solution.",
                    "Walk me through {a} on a small example, then show {lang} code.")
_CODE_PAIRS = (("lists", "tuples in Python"), ("let", "var in JavaScript"), ("==", "=== in JavaScript"),
               ("interfaces", "abstract classes in Java"), ("processes", "threads"), ("SQL", "NoSQL databases"), ("TCP", "UDP"),
               ("arrays", "linked lists"), ("map()", "forEach() in JavaScript"), ("structs", "classes in C++"),
               ("goroutines", "OS threads"), ("Box", "Rc in Rust"), ("an inner join", "a left join"), ("git merge", "git rebase"),
               ("unit tests", "integration tests"), ("a shallow copy", "a deep copy"), ("pass by value", "pass by reference"))
_CODE_PAIR_FORMS = ("What is the difference between {a} and {b}?", "When should I use {a} instead of {b}? Give examples.",
                    "Compare {a} and {b} with short code examples.")
_CODE_INTROS = ("",) * 10 + (
    "I'm new to programming. ", "I'm preparing for a technical interview. ", "This is for a school assignment. ",
    "I'm working on a small side project. ", "I'm a data analyst, not a developer, so keep it simple. ", "Please help! ",
)


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

_ITEMS = ("apples", "notebooks", "pencils", "concert tickets", "cookies", "marbles", "stickers", "oranges", "T-shirts",
          "cupcakes", "plant pots", "bus passes", "candles", "sandwiches", "tennis balls")
_MATH_ASKS = ("",) * 5 + (" Show your work.", " Explain step by step.", " Explain your reasoning.",
                          " Give just the final answer.", " Check your answer.", " Please show each step clearly.")
_ORD = ("first", "second", "third", "fourth", "fifth")


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


_WORDS = ("BANANA", "LETTER", "APPLE", "COFFEE", "PEPPER", "STATISTICS", "BALLOON", "GARDEN", "PUZZLE", "TOMATO", "CANADA",
          "BOOKKEEPER", "SUCCESS", "PARALLEL", "MATH", "ORANGE")


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


_UNITS = (("kilometres", "miles"), ("miles", "kilometres"), ("kilograms", "pounds"), ("pounds", "kilograms"),
          ("litres", "US gallons"), ("feet", "metres"), ("inches", "centimetres"), ("square metres", "square feet"),
          ("metres per second", "kilometres per hour"), ("kilometres per hour", "metres per second"), ("cups", "millilitres"),
          ("ounces", "grams"), ("hectares", "acres"), ("cubic metres", "litres"), ("days", "seconds"),
          ("nautical miles", "kilometres"), ("gigabytes", "megabytes"))


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
_SCENES = (("{names} ran a race, and there were no ties.", ("What was the finishing order?", "Who finished {ord}?"),
            {"before": "{a} finished ahead of {b}.", "after": "{a} finished immediately after {b}.", "at": "{a} finished {ord}.",
             "not_at": "{a} did not finish {ord}."}),
           ("{names} sit side by side in a row of {n} chairs.",
            ("Who sits where, from left to right?", "Who sits in the {ord} chair from the left?"),
            {"before": "{a} sits somewhere to the left of {b}.", "after": "{a} sits immediately to the right of {b}.",
             "at": "{a} sits in the {ord} chair from the left.", "not_at": "{a} is not in the {ord} chair from the left.",
             "next": "{a} sits next to {b}.", "apart": "{a} does not sit next to {b}."}),
           ("{names} all have different heights.", ("List them from tallest to shortest.", "Who is the {ord} tallest?"),
            {"before": "{a} is taller than {b}.", "at": "{a} is the {ord} tallest.", "not_at": "{a} is not the {ord} tallest."}),
           ("{names} arrived at a party one at a time.", ("In what order did they arrive?", "Who was the {ord} to arrive?"),
            {"before": "{a} arrived before {b}.", "after": "{a} arrived right after {b}.", "at": "{a} was the {ord} to arrive.",
             "not_at": "{a} was not the {ord} to arrive."}),
           ("{names} each live on a different floor of a {n}-storey building; floor 1 is the lowest.",
            ("Who lives on which floor?", "Who lives on floor {k}?"),
            {"before": "{a} lives lower than {b}.", "after": "{a} lives on the floor directly above {b}.",
             "at": "{a} lives on floor {k}.", "not_at": "{a} does not live on floor {k}.",
             "next": "{a} and {b} live on neighbouring floors.", "apart": "{a} and {b} do not live on neighbouring floors."}))
# (intro, is, is not, ask about one, ask about all, values)
_ATTRIBUTES = (("{names} each own one pet: {opts}.", "{a} owns {x}.", "{a} does not own {x}.", "Who owns {x}?",
                "Which pet belongs to whom?", ("a cat", "a dog", "a parrot", "a rabbit", "a tortoise")),
               ("{names} live in different cities: {opts}.", "{a} lives in {x}.", "{a} does not live in {x}.",
                "Who lives in {x}?", "Where does each of them live?", ("Paris", "Cairo", "Lima", "Oslo", "Perth")),
               ("{names} each drink something different at breakfast: {opts}.", "{a} drinks {x}.", "{a} never drinks {x}.",
                "Who drinks {x}?", "What does each person drink?", ("tea", "coffee", "orange juice", "milk", "cocoa")),
               ("{names} have different jobs, which are {opts} in some order.", "{a} is {x}.", "{a} is not {x}.", "Who is {x}?",
                "What is each person's job?", ("a doctor", "a pilot", "a teacher", "a baker", "an engineer")),
               ("{names} each play a different instrument: {opts}.", "{a} plays {x}.", "{a} does not play {x}.", "Who plays {x}?",
                "Which instrument does each person play?", ("the piano", "the violin", "the drums", "the flute", "the guitar")))
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


_ISLANDS = (("On an island, knights always tell the truth and knaves always lie.", "knight", "knave"),
            ("In a village, everyone is either a truth-teller, who never lies, or a liar, who never tells the truth.",
             "truth-teller", "liar"),
            ("Each of the following people either always tells the truth (a knight) or always lies (a knave).", "knight",
             "knave"))


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


_FAMILY = ("{m1} is the brother of {f1}, and {f1} is the mother of {m2}. What is {m1} to {m2}?",
           "{m1} and {f1} are siblings. {f2} is {f1}'s daughter. How is {f2} related to {m1}?",
           "{f1}'s mother is the sister of {m1}'s father. How are {f1} and {m1} related?",
           "Pointing at a photo of a woman, {m1} says: \"Her mother is my father's only daughter.\" How is the woman related to "
           "{m1}?", "{f1} is married to {m1}, and {m2} is {m1}'s son from an earlier marriage. How is {f1} related to {m2}?",
           "{f1} is the sister of {m1}'s wife. What is {f1} to {m1}?",
           "{f1} is the daughter of {m1}'s father's brother. How is {f1} related to {m1}?",
           "{f1} says: \"{m1}'s mother is my mother's only child.\" How is {m1} related to {f1}?",
           "{m1} is the father of {m2} and {f1}. {f1} has a daughter, {f2}, and {m2} has a son, {m3}. How are {f2} and {m3} "
           "related?",
           "{m1} has exactly two children, {f1} and {m2}. {m2} has one son, {m3}. How many aunts does {m3} have on his father's "
           "side, and who?")
_TERMS = ("bloops", "razzies", "lazzies", "wugs", "zorks", "glims", "tarps", "fizzles", "daxes", "painters", "cyclists",
          "teachers", "vegetarians", "early risers", "chess players", "musicians", "gardeners", "poets", "swimmers")
_SYLLOGISMS = ("All {A} are {B}, and all {B} are {C}. Does it follow that all {A} are {C}?",
               "All {A} are {B}. No {B} are {C}. Can any {A} be {C}?",
               "All {A} are {B}. Some {B} are {C}. Does it necessarily follow that some {A} are {C}?",
               "Some {A} are {B}, and some {B} are {C}. Must some {A} be {C}?",
               "No {A} are {B}. All {C} are {B}. What can you conclude about {A} and {C}?",
               "All {A} are {B}. {n} is not one of the {B}. Is {n} one of the {A}?",
               "Some {A} are not {B}. All {C} are {B}. Does it follow that some {A} are not {C}?")
# (if, then, then is false, then is true, if in the past)
_CONDITIONALS = (("it rains", "the match is cancelled", "The match was not cancelled.", "The match was cancelled.", "it rained"),
                 ("the bakery is open", "its lights are on", "The bakery's lights are off.", "The bakery's lights are on.",
                  "the bakery is open"),
                 ("{n} finishes the report", "{n} leaves work early", "{n} did not leave early.", "{n} left early.",
                  "{n} finished the report"),
                 ("the password is correct", "the door opens", "The door did not open.", "The door opened.",
                  "the password was correct"),
                 ("a number is divisible by 6", "it is divisible by 3", "The number is not divisible by 3.",
                  "The number is divisible by 3.", "the number is divisible by 6"),
                 ("the plant gets no water", "it wilts", "The plant did not wilt.", "The plant wilted.",
                  "the plant got no water"),
                 ("the train is late", "{n} misses the meeting", "{n} did not miss the meeting.", "{n} missed the meeting.",
                  "the train was late"))


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
_MATH_INTROS = ("",) * 10 + ("Can you help me with this? ", "Homework question: ", "Quick maths question: ",
                             "I'm stuck on this problem. ")


def _math_prompt(rng: random.Random) -> str:
    kind = rng.choices([k for k, _ in _MATH_KINDS], weights=[w for _, w in _MATH_KINDS])[0]
    return rng.choice(_MATH_INTROS) + kind(rng) + rng.choice(_MATH_ASKS)


# ---- writing ----

_TONES = ("humorous", "heartfelt", "formal", "casual", "optimistic", "melancholic", "suspenseful", "whimsical", "inspiring",
          "nostalgic", "gently sarcastic", "calm", "dramatic", "friendly", "poetic", "matter-of-fact")
_LENGTHS = ("in under 100 words", "in under 150 words", "in about 300 words", "in exactly three paragraphs",
            "in no more than five sentences", "in two short paragraphs", "in fewer than 50 words", "in one paragraph",
            "in about 500 words")
_AUDIENCES = ("children aged 6 to 8", "busy parents", "university students", "retirees", "first-time travellers",
              "small-business owners", "teenagers", "software engineers", "dog owners", "a general audience", "new employees",
              "people learning English")
_STORY_TOPICS = ("a lighthouse keeper who receives a letter from the future", "a lost dog finding its way home across the city",
                 "two rivals stuck in a lift", "a robot that wants to learn to paint",
                 "an old bookshop whose books rearrange themselves at night", "a chef who loses her sense of taste",
                 "a night train that never reaches its last stop", "a garden that grows overnight", "a musician's first concert",
                 "a family moving to a new country", "a letter found inside a second-hand coat",
                 "an astronaut's last day on the space station", "a storm that strands strangers in a roadside diner",
                 "a village festival gone wrong", "a door that appears in a child's bedroom wall",
                 "a retired detective and a missing cat", "the last tree on a dry planet",
                 "a grandmother who teaches her grandson to fish", "a town where it has not rained for ten years",
                 "a museum guard who talks to the paintings", "twins separated at a busy market",
                 "a shy girl who finds a dragon egg", "an inventor whose machine only works on Tuesdays",
                 "a postman delivering the very last letter", "a first date during a power cut",
                 "a boy who can hear what plants think", "a ship's cook on a long voyage",
                 "an old man's last day at his corner shop", "a friendship between a crow and a cat",
                 "a heist at a cheese museum", "a ghost who is afraid of people", "a snowed-in mountain hut",
                 "a girl who collects lost sounds")
_GENRES = ("", "", "science-fiction", "mystery", "fairy-tale", "ghost", "comic", "bedtime", "adventure", "fable-style",
           "romantic", "noir")
_STORY_TWISTS = ("", "", "", ", with a twist ending", ", told in the first person", ", told entirely in dialogue",
                 " that ends with a question", " in which the main character never speaks", ", set in the year 2150",
                 ", told from the point of view of an object", ", with a moral at the end")
_STORY_FORMS = ("Write {a_genre}story about {topic}{twist}.", "Tell me {a_genre}story about {topic}{twist}.",
                "Write a short story about {topic}, {length}.", "Write a piece of flash fiction about {topic}{twist}.",
                "Write {a_tone} story for {audience} about {topic}.",
                "Can you write a short story about {topic}? Make it {tone}.",
                "Write a diary entry by a character in a story about {topic}.")
_POEM_TYPES = ("haiku", "limerick", "sonnet", "free-verse poem", "rhyming poem", "ballad", "short poem in rhyming couplets",
               "villanelle", "series of three haiku", "cinquain", "ode", "prose poem", "poem of four quatrains")
_POEM_SUBJECTS = ("autumn leaves", "a cup of morning coffee", "the city at three in the morning", "a grandmother's hands",
                  "Monday mornings", "the moon over a car park", "a forgotten umbrella", "learning to ride a bike",
                  "the smell of rain", "a cat asleep in the sun", "the sea in winter", "a power cut", "the first snowfall",
                  "a houseplant that refuses to die", "old photographs", "a traffic jam", "a long-distance friendship",
                  "the last day of summer holidays", "a lighthouse", "bees in a lavender field", "a broken violin",
                  "the night shift at a hospital", "homesickness", "a kite on a windy hill", "a library at closing time",
                  "a train window", "the ocean at dawn", "a lost glove", "a thunderstorm", "the first day of spring",
                  "an empty playground", "a mountain summit", "a bowl of soup on a cold day")
_POEM_FORMS = ("Write {a_type} about {subject}.", "Compose {a_type} about {subject}.",
               "Write {a_type} about {subject} in {a_tone} tone.", "Can you write me {a_type} about {subject}?",
               "Write {a_type} about {subject} that a child would enjoy.",
               "Write an acrostic poem on the word {word} about {subject}.",
               "I need {a_type} about {subject} for a greeting card.")
_ACROSTICS = ("HOME", "RAIN", "SPRING", "FRIEND", "OCEAN", "MUSIC", "BREAD", "LIGHT", "DREAM", "AUTUMN")
_DESTINATIONS = ("Kyoto", "the Scottish Highlands", "Lisbon", "Patagonia", "Marrakech", "Iceland's Ring Road", "the Amalfi Coast",
                 "Hanoi", "Quebec City", "Cappadocia", "the Norwegian fjords", "Cartagena", "Tasmania", "Ljubljana", "Zanzibar",
                 "Oaxaca", "Bruges", "Sri Lanka", "Yellowstone", "Crete", "Montreal", "the Dolomites", "Luang Prabang",
                 "Valparaíso", "Tbilisi", "Seville", "New Zealand's South Island", "Edinburgh", "the Atacama Desert", "Istanbul",
                 "a small Greek island", "Vancouver Island")
_ISSUES = ("schools should start later in the morning", "cities should ban cars from their centres",
           "every student should learn to cook", "public transport should be free", "primary schools should drop homework",
           "museums should be free to enter", "companies should offer a four-day work week",
           "single-use plastic bags should be banned", "voting should be compulsory", "public libraries matter more than ever",
           "every child should learn a musical instrument", "zoos should be phased out", "cities need more trees",
           "students should take a gap year", "school uniforms should be abolished", "handwriting should still be taught",
           "people should repair things instead of replacing them", "video games can be good for children",
           "tipping should be replaced by fair wages", "adults should keep learning new skills",
           "towns should protect their independent shops")
_ESSAY_FORMS = ("Write a persuasive essay arguing that {i}.", "Write a persuasive paragraph arguing that {i}, {length}.",
                "Write an opinion piece for a local newspaper arguing that {i}.",
                "Write a short persuasive speech arguing that {i}.",
                "Write a persuasive essay arguing against the claim that {i}.", "Write a letter to the editor arguing that {i}.")
_PRODUCTS = ("a solar-powered phone charger shaped like a leaf", "waterproof earbuds for swimmers",
             "a smart water bottle that reminds you to drink", "a ceramic mug with a built-in tea-bag holder",
             "a folding electric scooter", "a weighted blanket made from bamboo", "a board game about running a lighthouse",
             "an app that plans meals from what is in your fridge", "a backpack with a built-in laptop stand",
             "organic peanut-butter dog biscuits", "a mechanical keyboard with wooden keycaps",
             "a reusable notebook that wipes clean", "a bicycle light that projects a lane onto the road",
             "a candle that smells like a rainy forest", "a kids' telescope", "a plant pot that texts you when the soil is dry",
             "hand-knitted wool socks", "a compact espresso maker for camping", "a language-learning podcast for commuters",
             "a noise machine that plays café sounds", "a lunch box that keeps food warm for six hours")
_PRODUCT_FORMS = ("Write a product description for {p}.",
                  "Write an online-store listing for {p}, with a title and five bullet points.", "Write catchy ad copy for {p}.",
                  "Come up with five slogans for {p}.", "Write a 30-second radio advert for {p}.",
                  "Write a short social media caption launching {p}.",
                  "Write a product description for {p} aimed at {audience}, {length}.",
                  "Write a crowdfunding campaign pitch for {p}.")
_EMAILS = {"my manager": ("ask for a day off next Friday", "ask for a raise after two years in the role",
                          "explain why a project will be a week late", "propose working from home two days a week",
                          "turn down an extra project because of my workload", "resign with four weeks' notice"),
           "a client": ("apologise for a delayed delivery", "follow up on an unpaid invoice", "propose a new pricing plan",
                        "confirm the details of next week's meeting", "thank them for their business this year",
                        "explain a change in the project scope"),
           "my landlord": ("report a leaking kitchen tap", "ask permission to keep a cat", "ask for my security deposit back",
                           "complain about a broken heater", "ask to end the lease two months early"),
           "my child's teacher": ("explain my child's absence last week", "ask how my child can improve in reading",
                                  "request a meeting about a bullying concern", "thank them at the end of the school year"),
           "my professor": ("ask for an extension on an essay", "request a recommendation letter",
                            "ask about joining their research group", "politely question a grade"),
           "a colleague": ("ask for help with a spreadsheet", "hand over my tasks before a holiday",
                           "congratulate them on a promotion", "apologise for missing a meeting"),
           "my neighbour": ("ask them to trim a hedge that blocks the path", "invite them to a street party",
                            "apologise for noise from a party"),
           "a company's customer service team": ("complain about a faulty washing machine",
                                                 "ask for a refund for a cancelled flight", "cancel a gym membership"),
           "a hiring manager": ("follow up after a job interview", "accept a job offer and confirm the start date",
                                "decline a job offer politely")}
_EMAIL_FORMS = ("Write a professional email to {r} to {p}.", "Draft a polite email to {r} to {p}.",
                "Help me write an email to {r}: I need to {p}. Keep it {tone}.", "Write a short email to {r} to {p}, {length}.",
                "Write an email to {r} to {p}. Include a clear subject line.")
_JOBS = ("junior data analyst at a retail company", "barista at a busy café", "nurse on a children's ward",
         "primary-school teacher", "graphic designer at an advertising agency", "park ranger",
         "software developer at a fintech start-up", "museum guide", "marketing assistant", "laboratory technician",
         "customer support agent", "sous-chef", "librarian", "event planner", "bicycle mechanic", "UX researcher",
         "warehouse team lead", "translator", "veterinary assistant", "youth football coach")
_BACKGROUNDS = ("I have just graduated", "I am changing careers after ten years in retail", "I have three years of experience",
                "I am returning to work after raising my children", "I volunteered for two years at a community centre",
                "I speak three languages", "I have no formal experience but lots of enthusiasm")
_OCCASIONS = ("a best man's toast at a wedding", "a graduation speech for a high-school class",
              "a retirement speech for a colleague of 30 years", "a welcome speech for new team members",
              "an acceptance speech for a community award", "a eulogy for a beloved family dog",
              "a speech opening a school science fair", "a pep talk before a football final", "a toast at a 50th birthday party",
              "a farewell speech on my last day at work", "a speech thanking volunteers at a charity dinner")
_ANNOUNCEMENTS = ("a bakery's new sourdough loaf", "a local charity run", "finishing my first marathon", "starting a new job",
                  "a library's summer reading challenge", "a dog adoption day at the shelter",
                  "a small bookshop's tenth anniversary", "a beach clean-up this Saturday", "the launch of a gardening podcast",
                  "a pop-up vintage clothing market", "a community theatre's new play")
_PLATFORMS = ("Instagram", "LinkedIn", "X (Twitter)", "Facebook", "Threads")
_FILMS = (("Northern Static", "science-fiction thriller",
           "a radio operator at an Arctic station who hears a voice from the future"),
          ("The Paper Orchard", "family drama", "three sisters who inherit a failing apple farm"),
          ("Mile Marker Nine", "road-trip comedy", "two estranged brothers driving their father's ashes across the country"),
          ("Saltwater Kings", "heist film", "a crew planning to steal a pearl from a floating casino"),
          ("Hollow Season", "horror film", "a village where the scarecrows move at night"),
          ("The Quiet Engine", "animated film", "a little train that is afraid of tunnels"),
          ("Glass Rivers", "romantic drama", "two glassblowers competing for the same commission in Venice"),
          ("Zero Gravity Kitchen", "comedy", "a chef hired to cook on a space station"))
_PLACES = ("a Nepalese dumpling house called Momo Corner", "a seaside fish restaurant called The Tide Table",
           "a vegan burger bar called Green Bun", "a family-run trattoria called Nonna's Table",
           "a rooftop tapas bar called Altura", "a ramen shop called Steam & Salt", "a breakfast café called The Early Bird")
_GADGETS = ("the Orbit X2 wireless earbuds", "a budget smartwatch called PulseBand Lite", "the Brewly smart kettle",
            "a robot vacuum called Dustin", "the Lumo 4K projector", "a folding phone called the Flipside Pro",
            "an e-reader called PageLight")
_REVIEW_FORMS = ("Write {a_stance} review of the film \"{title}\", {a_genre} about {premise}.",
                 "Write {a_stance} restaurant review of {place} for a food blog.",
                 "Write {a_stance} review of {gadget}, giving it {stars} out of 5 stars.",
                 "Write a customer review of {gadget} that is {stance}, {length}.",
                 "Write {a_stance} review of {place}: the food was {food} but the service was {service}.")
_PARAGRAPHS = ("Our office will be closed on Monday for the public holiday. Any urgent requests should be sent to the support "
               "inbox, which will be checked once in the afternoon. Normal hours resume on Tuesday.",
               "The new park on River Street opened last weekend. It has a playground, a small pond and plenty of benches. Dogs "
               "are allowed on a lead.",
               "I tried the recipe last night. The sauce was too salty and the pasta took longer than the instructions said, "
               "but my kids still liked it.",
               "Due to rising costs, the monthly membership fee will increase from 30 to 35 dollars starting in March. Members "
               "who pay for a full year in advance keep the old price.",
               "The meeting ran over by an hour because nobody had prepared an agenda. We agreed on nothing except that we need "
               "another meeting.",
               "Our team finished the project two weeks early. Sales are up, the client is happy, and everyone deserves a break.",
               "The train was delayed again this morning. I waited on the platform for forty minutes in the rain and missed the "
               "start of my exam.",
               "Please remember to switch off the lights and lock the back door when you leave the building in the evening.",
               "The museum's new dinosaur exhibit features a full-size skeleton, touchable fossils and a short film about how "
               "the dinosaurs died out.",
               "Our cat has learned to open the fridge. We have tried everything, including tape and a child lock, and she "
               "still gets in.")
_STYLES = ("a formal business tone", "a friendly, casual tone", "the style of a children's book", "a pirate's voice",
           "plain English for a ten-year-old", "a more persuasive tone", "half the length", "a single tweet",
           "the style of a Shakespeare play", "the voice of a sports commentator", "a polite, apologetic tone",
           "the voice of a dramatic movie-trailer narrator", "the style of a Victorian letter", "an upbeat marketing tone",
           "the style of a news report")
_REWRITE_FORMS = ("Rewrite the following paragraph in {style}:\n\n\"{p}\"", "Rewrite this in {style}: {p}",
                  "Here is a paragraph:\n\n{p}\n\nRewrite it in {style}, keeping the meaning.",
                  "Turn this text into {style}:\n{p}")
_PERSONAS = ("a pirate captain", "a hard-boiled 1940s detective", "a medieval knight", "an eccentric Victorian inventor",
             "a scientist who gets very excited about experiments", "a sleepy dragon", "a grumpy old lighthouse keeper",
             "a cheerful robot butler", "an alien visiting Earth for the first time", "a 1920s jazz singer", "a celebrity chef with very strong opinions",
             "a time traveller from the year 3000", "a cowboy on a cattle drive", "an overly dramatic theatre critic",
             "a cat who can talk", "a Roman senator", "a calm yoga teacher", "a superhero on a day off",
             "a ship's captain in a storm")
_QUESTIONS = ("what do you think of smartphones?", "how should I spend a rainy Sunday?", "what is the secret to a happy life?",
              "how do I make friends in a new city?", "describe your morning routine.", "is pineapple acceptable on pizza?",
              "how do I stay motivated to exercise?", "what advice do you have for a nervous student before an exam?",
              "what is your greatest fear?", "tell me about the best meal you have ever had.",
              "how should I ask my boss for a raise?", "what do you do to relax?",
              "what do you think about people who are always late?", "how would you spend a million dollars?",
              "what is the best way to learn to cook?")
_ACTS = {"travel agent": ("plan a five-day trip to {d} for a couple on a mid-range budget",
                          "suggest a weekend getaway for a family with a toddler"),
         "fitness coach": ("design a four-week beginner running plan", "create a 20-minute home workout with no equipment"),
         "interview coach": ("prepare me for a job interview (the role: {job}) by asking me questions one at a time",),
         "chef": ("suggest a dinner menu for six guests, one of whom is vegan", "help me plan a week of cheap, healthy lunches"),
         "career counsellor": ("help me decide between two job offers",
                               "help me figure out whether to go back to university at 35"),
         "tour guide": ("give me a walking tour of {d}", "tell me the story of an old harbour town as we walk through it"),
         "stand-up comedian": ("write a short routine about working from home",
                               "do five minutes on the chaos of family group chats"),
         "motivational coach": ("help me stop procrastinating on my thesis", "give me a pep talk before my driving test"),
         "storyteller": ("tell a bedtime story about a sleepy hedgehog", "tell a spooky campfire story for teenagers"),
         "debate coach": ("help me prepare arguments for a debate on whether {i}",),
         "screenwriter": ("write a short scene in which two strangers share an umbrella",
                          "write the opening of a sitcom set in a laundrette"),
         "poet": ("write a poem for my parents' 40th wedding anniversary", "write a poem I can read at my sister's graduation")}
_MISC_WRITING = ("Write a letter to your future self, to be opened in ten years.",
                 "Write a thank-you note to a nurse who cared for my grandfather.",
                 "Write an apology letter from a cat to its owner for knocking a vase off the table.",
                 "Write the lyrics of a country song about a broken-down tractor.",
                 "Write a dialogue between a barista and a customer who cannot decide what to order.",
                 "Write a fairy tale that takes place inside a washing machine.",
                 "Write ten funny one-line jokes about working in an office.",
                 "Write a children's picture-book text about a cloud who wants to be a rainbow.",
                 "Write a bedtime story about a penguin who is scared of the dark.",
                 "Write a funny horoscope for each of the four seasons.",
                 "Write the back-cover blurb for a mystery novel set on a cruise ship.",
                 "Write a motivational quote and a short paragraph explaining it.",
                 "Write a wedding invitation for a couple getting married in a lighthouse.",
                 "Write a short monologue for a villain who just wants a quiet life.",
                 "Write a to-do list written by a very busy squirrel.", "Write a recipe as if it were an epic poem.",
                 "Write a love letter from the Moon to the Sun.",
                 "Write a movie pitch for a comedy about grandparents who start a rock band.",
                 "Write three riddles whose answers are household objects.", "Write an obituary for a pair of old running shoes.",
                 "Write a welcome message for the first page of a community cookbook.")
_WRITING_EXTRAS = ("",) * 8 + (" Use a title.", " Keep the language simple.", " Avoid clichés.", " End with a call to action.",
                              " Use vivid sensory details.", " Make it memorable.")


_COVER_FORMS = ("Write a cover letter for a job as {a_job}. {bg}.",
                "Help me write a cover letter. The job: {job}. Some background: {bg}.",
                "Write a short cover letter (under 250 words) for a role as {a_job}.")
_SPEECH_FORMS = ("Write {o}.", "Write {o}, {length}.", "Write {o}. Make it {tone} but not too long.")
_SOCIAL_FORMS = ("Write a {pl} post announcing {a}.", "Write three {pl} posts promoting {a}.",
                 "Write a {pl} post about {a}, with hashtags.", "Write a 30-second TikTok video script about {a}.")
# a "but" that contrasts: (food, service)
_FOOD_SERVICE = (("superb", "painfully slow"), ("bland", "charming"), ("generous", "rude"), ("overpriced", "attentive"),
                 ("cold", "friendly"), ("delicious", "chaotic"))
_STANCES = ("glowing", "mixed", "harsh but fair", "lukewarm", "enthusiastic", "balanced")
_ROLEPLAY_FORMS = ("Pretend you are {p}. Stay in character and answer: {q}",
                   "You are {p}. Someone asks you: \"{Q}\" How do you reply?", "Speak like {p} and answer this: {q}",
                   "From now on, respond as {p}. First question: {q}")
_ACT_FORMS = ("Act as {r}. Please {q}.", "I want you to act as {r}. Your first task: {q}.",
              "Imagine you are my personal {role}: {q}.")


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
_TOPICS = ("Newton's third law", "the Doppler effect", "entropy", "the photoelectric effect", "special relativity",
           "electromagnetic induction", "buoyancy", "quantum tunnelling", "the conservation of energy", "static electricity",
           "oxidation and reduction", "the pH scale", "catalysis", "covalent bonding", "the layout of the periodic table",
           "radioactive decay", "fermentation", "natural selection", "the immune system", "DNA replication",
           "the role of mitochondria", "a food web", "symbiosis", "epigenetics", "the nervous system", "cell division",
           "a black hole", "the life cycle of a star", "dark matter", "the Big Bang theory", "an exoplanet", "a solar eclipse",
           "the lunar cycle", "the placebo effect", "herd immunity", "blood pressure", "type 2 diabetes", "an allergic reaction",
           "the circadian rhythm", "antibiotic resistance", "the gut microbiome", "plate tectonics", "the water cycle",
           "the greenhouse effect", "the rock cycle", "El Niño", "the ozone layer", "soil erosion",
           "public-key encryption", "a blockchain", "cloud computing", "two-factor authentication",
           "a semiconductor", "inflation", "supply and demand", "opportunity cost", "comparative advantage", "compound interest",
           "a recession", "central-bank interest-rate policy", "the tragedy of the commons", "game theory",
           "a stock market index", "utilitarianism", "stoicism", "the trolley problem", "existentialism",
           "Plato's allegory of the cave", "the social contract", "the ship of Theseus", "Occam's razor",
           "cognitive dissonance", "confirmation bias", "the Dunning-Kruger effect", "classical conditioning",
           "Maslow's hierarchy of needs", "a growth mindset", "working memory", "the bystander effect", "Impressionism",
           "perspective in Renaissance painting", "the sonata form", "Art Deco architecture", "the hero's journey", "Cubism",
           "jazz improvisation", "Gothic architecture", "the separation of powers", "the rule of law",
           "a constitutional monarchy", "federalism", "proportional representation", "due process", "intellectual property",
           "a referendum", "the role of a supreme court", "the Silk Road", "feudalism", "the printing press", "colonialism",
           "globalisation")
_TOPIC_FORMS = ("Explain {t} in simple terms.", "What is {t}?", "Can you explain {t} to a 10-year-old?",
                "Give me a clear explanation of {t}, with an everyday example.", "What is meant by {t}, and why does it matter?",
                "Explain {t} for a high-school student.", "I never really understood {t}. Could you break it down?",
                "Explain {t} in three short paragraphs.", "Summarise the key ideas behind {t} in five bullet points.",
                "What are common misconceptions about {t}?", "How would you explain {t} using an analogy?",
                "Explain {t} and give a real-world example.", "Tell me about {t}.", "Why is {t} important? Give two examples.",
                "Teach me {t} as if I were a complete beginner.")
_HOW_WHY = ("how a refrigerator keeps food cold", "how the heart pumps blood around the body",
            "how vaccines train the immune system", "how GPS works out your position",
            "how a bill becomes law in a typical parliament", "how noise-cancelling headphones work",
            "how a nuclear power plant makes electricity", "how aeroplanes stay in the air", "how the kidneys filter blood",
            "how a card payment is processed", "how search engines rank web pages", "how bees make honey", "how a rainbow forms",
            "how the Moon causes tides", "how a microwave oven heats food", "how memories are formed",
            "how a seed grows into a plant", "how solar panels turn sunlight into electricity", "how a compass finds north",
            "how hurricanes form", "how glass is made", "how chocolate is made from cacao beans",
            "how a touchscreen detects a finger", "how an MRI scanner makes images",
            "how banknotes are protected against forgery", "how a pin-tumbler lock works",
            "how the body regulates its temperature", "how coral reefs form", "why the sky is blue", "why we have seasons",
            "why leaves change colour in autumn", "why ice floats on water", "why we dream", "why the ocean is salty",
            "why cats purr", "why bread goes stale", "why prices tend to rise over time", "why the Romans built so many roads",
            "why the Moon always shows the same face to Earth", "why onions make us cry", "why aeroplanes leave white trails",
            "why we get goosebumps", "why some countries drive on the left", "why metal feels colder than wood",
            "why yawning is contagious", "why time zones exist", "why birds migrate", "what causes the northern lights",
            "what causes earthquakes", "what makes a volcano erupt", "why interest rates affect house prices",
            "why stars twinkle", "why we need sleep", "why empires decline")
_HOW_WHY_FORMS = ("Explain {h}.", "Can you explain {h}?", "Explain {h}, step by step.", "Explain {h} to a 10-year-old.",
                  "I've always wondered {h}. Can you explain?", "Describe {h} in simple terms.",
                  "In a numbered list, explain {h}.", "Give me a short, clear explanation of {h}.",
                  "My kid asked me {h}. How should I explain it?", "What is the science behind {h}?")
_PAIRS = (("mitosis", "meiosis"), ("weather", "climate"), ("viruses", "bacteria"), ("capitalism", "socialism"),
          ("the Renaissance", "the Enlightenment"), ("stocks", "bonds"), ("nuclear fission", "nuclear fusion"),
          ("alligators", "crocodiles"), ("comets", "asteroids"), ("DNA", "RNA"), ("civil law", "criminal law"),
          ("Baroque music", "Classical-era music"), ("Impressionism", "Expressionism"), ("introverts", "extroverts"),
          ("Stoicism", "Epicureanism"), ("AC electricity", "DC electricity"), ("hurricanes", "tornadoes"),
          ("renewable energy", "fossil fuels"), ("Keynesian economics", "monetarism"), ("an MRI", "a CT scan"),
          ("psychology", "psychiatry"), ("ancient Athens", "Sparta"), ("the Inca Empire", "the Aztec Empire"),
          ("speed", "velocity"), ("heat", "temperature"), ("elements", "compounds"), ("vaccines", "antibiotics"),
          ("stars", "planets"), ("the Arctic", "the Antarctic"), ("Gothic architecture", "Romanesque architecture"),
          ("Hinduism", "Buddhism"), ("inflation", "deflation"), ("fixed-rate mortgages", "variable-rate mortgages"),
          ("RAM", "storage"), ("Wi-Fi", "Bluetooth"), ("the metric system", "the imperial system"),
          ("a presidential system", "a parliamentary system"), ("empiricism", "rationalism"))
_PAIR_FORMS = ("Compare {a} and {b}.", "What is the difference between {a} and {b}?",
               "How do {a} and {b} differ, and what do they have in common?", "Make a table comparing {a} and {b}.",
               "{A} vs {b}: explain the key differences in simple terms.",
               "Explain the similarities and differences between {a} and {b}.")
_DEBATES = ("nuclear power", "a four-day work week", "remote work", "universal basic income", "electric cars", "homeschooling",
            "social media for teenagers", "genetically modified crops", "standardised testing", "funding space exploration",
            "a cashless society", "rent control", "tariffs on imports", "a sugar tax", "daylight saving time",
            "self-driving cars", "open-plan offices", "online learning", "tourism in small historic towns", "lab-grown meat",
            "year-round schooling", "wind farms at sea")
_DEBATE_FORMS = ("What are the pros and cons of {d}?", "Give a balanced overview of the arguments for and against {d}.",
                 "List three advantages and three disadvantages of {d}.", "Is {d} a good idea? Consider both sides.",
                 "What do economists and critics say about {d}?")
_EVENTS = ("the fall of the Western Roman Empire", "the French Revolution", "the Industrial Revolution", "the Black Death",
           "the 2008 financial crisis", "the invention of the printing press", "the collapse of the Soviet Union",
           "the Dust Bowl", "the extinction of the dinosaurs", "the Little Ice Age", "the Apollo Moon landings",
           "the rise of the internet", "the Protestant Reformation", "the Meiji Restoration", "the American Civil War",
           "the First World War", "the decolonisation of Africa", "the Green Revolution in agriculture", "the Great Depression",
           "the Cuban Missile Crisis", "the spread of the Mongol Empire", "the Columbian Exchange", "the Scientific Revolution")
_EVENT_FORMS = ("What were the main causes of {e}?", "What were the causes and consequences of {e}?",
                "Explain the long-term effects of {e}.", "Why did {e} happen, and why does it still matter today?",
                "Give a short timeline of {e}.", "Summarise {e} in one paragraph.",
                "How did {e} change everyday life for ordinary people?")
_PHENOMENA = ("coral bleaching", "urban heat islands", "rising sea levels", "insomnia", "traffic jams", "acid rain",
              "ocean dead zones", "droughts", "wildfires", "food inflation", "loneliness in big cities", "migraines",
              "plastic in the oceans", "soil salinisation")
_PHENOMENON_FORMS = ("What causes {p}, and what are its effects?", "Explain the causes of {p} and what can be done about it.",
                     "What is the cause-and-effect chain behind {p}?")
_FIGURES = ("Marie Curie", "Isaac Newton", "Ada Lovelace", "Charles Darwin", "Nelson Mandela", "Hypatia", "Leonardo da Vinci",
            "Ibn Sina", "Mansa Musa", "Confucius", "Galileo Galilei", "Florence Nightingale", "Alan Turing", "Rosalind Franklin",
            "Simón Bolívar", "Elizabeth I", "Frida Kahlo", "Johann Sebastian Bach", "Mahatma Gandhi", "Wangari Maathai",
            "Nikola Tesla", "Zheng He", "Harriet Tubman", "Adam Smith", "Immanuel Kant", "Hokusai", "Gregor Mendel")
_FIGURE_FORMS = ("Who was {f}, and why are they remembered today?", "Summarise the life and achievements of {f}.",
                 "What were the most important contributions of {f}?", "Give a short overview of {f}'s work and its influence.")
_REGIONS = ("the Amazon rainforest", "the Sahara", "the Himalayas", "the Great Barrier Reef", "the Nile delta", "Iceland",
            "the Mekong River", "the Andes", "Siberia", "the Pacific Ring of Fire", "the Great Lakes", "the Atacama Desert",
            "Antarctica", "the Netherlands' polders", "the Mediterranean coast", "the Serengeti", "the Galápagos Islands",
            "the Ganges basin")
_REGION_FORMS = ("Describe the geography and climate of {r}.", "What makes {r} unique, geographically and ecologically?",
                 "What environmental threats does {r} face?", "How have people adapted to life in or near {r}?")
_KNOWLEDGE_EXTRAS = ("",) * 8 + (" Keep it under 150 words.", " Use bullet points.", " Include a concrete example.",
                                 " Avoid jargon.", " End with a one-sentence summary.", " Answer in two paragraphs.",
                                 " Mention one common misconception.")

_COMPANIES = ("Norvale Systems", "Brightwater Foods", "Keltra Motors", "Oakfield Pharma", "Sunmere Energy", "Pivotal Freight",
              "Redwing Apparel", "Corvan Analytics", "Tidewell Shipping", "Glasshouse Games", "Verdant Farms", "Halcyon Telecom",
              "Ashgrove Bank", "Marlow Robotics")
_CITIES = ("Lisbon", "Toronto", "Nairobi", "Osaka", "Melbourne", "Austin", "Lyon", "Seoul", "Cape Town", "Oslo", "Monterrey",
           "Pune", "Glasgow", "Porto Alegre")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
           "December")
_GOOD_DRIVERS = ("strong demand in Asia", "a popular new budget product line", "lower shipping costs", "a record holiday season",
                 "new contracts with hospitals")
_BAD_DRIVERS = ("weak consumer spending", "higher energy prices", "a product recall in the spring", "supply-chain delays",
                "fierce price competition")
# (what happened, a detail with {n}, what comes next, range of n)
_NEWS = (("a new pedestrian bridge over the river opened", "about {n:,} people crossed it on the first day",
          "a second bridge is planned for 2031", (500, 20000)),
         ("heavy rain flooded several streets in the old town", "{n} homes were evacuated overnight",
          "repairs are expected to take two weeks", (10, 400)),
         ("a three-day food festival began", "more than {n:,} visitors are expected",
          "the festival will close with a fireworks show on Sunday", (5000, 80000)),
         ("the city council approved a new cycling plan", "{n} km of protected bike lanes will be built",
          "construction starts next spring", (5, 120)),
         ("a power cut hit the eastern districts", "about {n:,} homes lost electricity for up to six hours",
          "the grid operator has promised an inquiry", (1000, 60000)),
         ("volunteers planted trees along the harbour front", "{n:,} saplings went into the ground",
          "the group hopes to double that next year", (100, 5000)),
         ("the central library reopened after a renovation", "{n:,} new books were added to the collection",
          "opening hours will be extended in summer", (500, 20000)))
_ROLES = ("the mayor", "a city spokesperson", "a local councillor", "a council official", "the deputy mayor")
_STORE = (("AeroBrew coffee grinder", "kitchen"), ("TrailLite 2 tent", "outdoors"), ("PixelQuill stylus", "electronics"),
          ("HomeHalo smart bulb", "electronics"), ("Cascade water filter", "kitchen"), ("Summit trekking poles", "outdoors"),
          ("Nimbus pillow", "bedroom"), ("Echo Mini speaker", "electronics"), ("Forge cast-iron pan", "kitchen"),
          ("DriftWool blanket", "bedroom"), ("Beacon head torch", "outdoors"), ("Quill & Co notebook", "stationery"),
          ("Tempo desk clock", "stationery"), ("Aurora reading lamp", "bedroom"))
_TITLES = ("The Salt Orchard", "Glass Rivers", "A Map of Small Hours", "Iron and Ivy", "The Quiet Engine", "Lanterns at Low Tide",
           "The Cartographer's Daughter", "Seven Winters in Vell", "Paper Moons", "The Last Honest Clock", "Under the Copper Sky",
           "A Field Guide to Leaving")
_BOOK_GENRES = ("mystery", "fantasy novel", "historical novel", "science-fiction novel", "memoir", "thriller", "romance",
                "popular-science book", "short-story collection")
_PREMISES = ("a detective who can't remember faces", "a family of clockmakers during a war",
             "a city that floats above the clouds", "a chemist who discovers a new colour", "a year spent living on a canal boat",
             "two rival bakers in a seaside town", "the hidden life of fungi", "a heist inside a national archive",
             "a girl who trains a wolf", "a lighthouse on a drifting island")
# mood-labelled lines, generic enough for any product or place
_REVIEW_SNIPPETS = (
    "Absolutely love it; it exceeded every expectation.", "Great value for money, and delivery was quick.",
    "Works perfectly and looks even better in person.", "Five stars. I have already recommended it to my sister.",
    "Exactly as described, and the customer service was friendly.", "Better than the expensive brand I used before.",
    "Broke after two days and support never replied.", "Far too expensive for what you get.",
    "Arrived late and the box was damaged.", "Honestly the worst purchase I have made this year.",
    "Stopped working after a week. Avoid.", "Nothing like the photos, and the refund took a month.",
    "Good quality, but the instructions were confusing.", "Decent overall, though I waited almost an hour.",
    "Comfortable, but it runs small, so order a size up.", "Nice design; the battery life could be better.",
    "Does the job, but I expected more at this price.", "Fine for a week of use, not sure about the long run.",
)
_PROJECTS = ("website redesign", "spring catalogue", "customer app", "charity gala", "office move", "product launch")
_NOTE_TASKS = ("draft the press release", "book the venue", "update the budget spreadsheet", "send invitations to partners",
               "test the checkout flow", "order the printed banners", "brief the design agency")


_PERIODS = ("the first quarter of", "the second quarter of", "the third quarter of", "the fourth quarter of",
            "the financial year")
_REVIEWED = ("headphones", "hotel", "pizza place", "phone case", "yoga studio", "e-reader", "airline", "hiking boots")


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
_PROSE = ("company report", "news item", "set of book descriptions", "set of meeting notes")
_EXTRACT_TASKS = ("Summarise the passage in one sentence.",
                  "List every number in the passage and what it refers to.", "Extract all dates and times mentioned.",
                  "Write three questions that can be answered from the passage, with their answers.",
                  "Identify the main point of the passage in ten words or fewer.")
_EXTRACT_FORMS = ("{task}\n\n{text}", "Read the following {kind}.\n\n{text}\n\n{task}",
                  "{text}\n\nBased only on the text above: {task_lc}", "Here is a {kind}:\n\"\"\"\n{text}\n\"\"\"\n{task}",
                  "Passage:\n{text}\n\nTask: {task}")


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
