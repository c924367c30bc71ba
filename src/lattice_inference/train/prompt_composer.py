"""Varied chat requests composed from slots, so self-distilled training text covers many kinds of answer.

The fixed template x topic pool of `train.prompts` is narrow: an MTP head trained on its answers learns their
phrasing and does markedly worse on requests of other shapes. Here each request picks a kind of task (explain,
tips, email, poem, story, comparison, plan, recipe, code, ...), fills its slots (topic, audience, length, count,
person, ...) and sometimes adds a constraint and a system prompt, all from a seeded generator: thousands of
distinct conversations. The phrasings are this module's own, not the benchmark sets'.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

_SUBJECTS = [
    "volcanoes", "tides", "the immune system", "electricity", "bridges", "the solar system", "bees", "coral reefs",
    "the Roman Empire", "inflation", "taxes", "credit cards", "machine learning", "databases", "spreadsheets",
    "version numbers in software", "web browsers", "passwords", "cloud storage", "batteries", "wind turbines",
    "recycling plastic", "the water cycle", "earthquakes", "chess openings", "jazz", "the violin",
    "watercolour painting", "photography", "knitting", "marathon training", "stretching", "vitamins", "sleep cycles",
    "meditation",
    "time management", "public speaking", "job interviews", "writing a CV", "saving for a holiday", "budgeting",
    "renting a flat", "growing tomatoes", "houseplants", "composting", "bird watching", "camping", "maps",
    "the metric system", "fractions", "percentages", "prime numbers", "probability", "statistics", "algebra",
    "sorting algorithms", "hash maps", "unit tests", "regular expressions", "SQL queries", "APIs", "JSON",
    "the command line", "open-source software", "encryption", "email etiquette", "the printing press", "trains",
    "airports", "lighthouses", "deserts", "glaciers", "rainforests", "octopuses", "elephants", "wolves",
]  # fmt: skip
_AUDIENCES = [
    "a seven-year-old", "a beginner", "my grandmother", "a busy manager", "a high school student",
    "someone who is not technical", "a friend who has never heard of it",
]  # fmt: skip
_PEOPLE = ["Alex", "Priya", "Tom", "Maria", "Kenji", "Lena", "Omar", "Chloe"]
_RELATIONS = ["friend", "neighbour", "manager", "teacher", "cousin", "landlord", "team"]
_REASONS = [
    "to say I will be late to our meeting", "to invite them to a picnic on Saturday", "to ask for a day off next week",
    "to apologise for missing their call", "to congratulate them on a new job", "to ask to borrow a ladder",
    "to remind them about the book club", "to say thank you for a birthday present",
]  # fmt: skip
_FOODS = [
    "a lentil soup", "fried rice", "banana bread", "a tomato salad", "scrambled eggs", "guacamole", "oatmeal",
    "a vegetable curry", "garlic bread", "a fruit smoothie", "roast potatoes", "a simple omelette",
]  # fmt: skip
_SITUATIONS = [
    "on a sunny afternoon in a big city", "with friends at the beach", "on a long train journey", "on a snowy evening",
    "with a group of teenagers", "on a very small budget", "in a small town with no cinema", "during a power cut",
]  # fmt: skip
_PHENOMENA = [
    "ice float on water", "bread rise in the oven", "the moon change shape", "leaves turn red in the autumn",
    "a compass point north", "we have seasons", "metal feel colder than wood", "the sea taste salty",
    "onions make people cry", "planes stay in the air", "we get hiccups", "stars twinkle",
]  # fmt: skip
_PROBLEMS = [
    "staying focused when I work from home", "waking up early", "keeping my desk tidy", "remembering names",
    "drinking enough water", "too many emails", "feeling nervous before exams", "procrastinating on chores",
]  # fmt: skip
_CODE = [
    "counts the vowels in a string", "returns the largest number in a list", "checks whether a word is a palindrome",
    "merges two sorted lists", "removes duplicates from a list but keeps the order", "converts Celsius to Fahrenheit",
    "reads a text file and counts its lines", "computes the average of a list of numbers", "finds the longest word",
    "returns the n-th Fibonacci number", "checks that a password has at least eight characters and one digit",
]  # fmt: skip
_PAIRS = [
    ("weather", "climate"), ("a virus", "a bacterium"), ("memory", "storage in a computer"), ("a simile", "a metaphor"),
    ("speed", "velocity"), ("HTTP", "HTTPS"), ("a loan", "a grant"), ("a set", "a dictionary in Python"),
    ("an alligator", "a crocodile"), ("baking soda", "baking powder"), ("a comet", "an asteroid"),
    ("renting", "buying a home"),
]  # fmt: skip
_CHARACTERS = [
    "a shy dragon", "an old lighthouse keeper", "a curious cat", "a girl named Mia", "a lost penguin",
    "a retired astronaut", "a talking teapot", "two brothers",
]  # fmt: skip
_PLOTS = [
    "learns to play the piano", "finds a hidden garden", "makes an unlikely friend", "is afraid of the dark",
    "wants to see the mountains", "builds a boat", "wins a baking contest", "gets lost in a big city",
]  # fmt: skip
_JOBS = ["a nurse", "a baker", "a software developer", "a farmer", "a pilot", "a librarian", "a zookeeper"]
_THINGS = [
    "a reusable water bottle", "a pair of running shoes", "a desk lamp", "a hiking backpack", "a paper notebook",
    "a bicycle bell", "a wool scarf",
]  # fmt: skip
_CONSTRAINTS = [
    "", "", "", " Keep it short.", " Use simple words.", " Answer in one paragraph.", " Use a numbered list.",
    " Be brief.", " Give one example.", " Keep it under 120 words.",
]  # fmt: skip
_SYSTEMS = [
    None, None, "You are a helpful assistant.", "You are a concise, friendly assistant.",
    "You are a knowledgeable assistant. Keep your answers clear and short.",
    "You are a patient teacher who explains things simply.",
]  # fmt: skip

Pick = Callable[[list], object]

_TASKS: list[Callable[[Pick, random.Random], str]] = [
    lambda c, r: f"Explain {c(_SUBJECTS)} to {c(_AUDIENCES)}.",
    lambda c, r: f"What is {c(_SUBJECTS)}, and why does it matter? Explain in plain words.",
    lambda c, r: f"Give me {r.randint(3, 7)} practical tips about {c(_SUBJECTS)}.",
    lambda c, r: f"I struggle with {c(_PROBLEMS)}. What could help? Give me {r.randint(3, 6)} ideas.",
    lambda c, r: f"Write a short message to my {c(_RELATIONS)} {c(_PEOPLE)} {c(_REASONS)}.",
    lambda c, r: f"Write a poem of {r.choice((4, 6, 8, 10))} lines about {c(_SUBJECTS)}.",
    lambda c, r: f"Write {r.randint(2, 4)} haiku about {c(_SUBJECTS)}.",
    lambda c, r: f"Tell me a short story about {c(_CHARACTERS)} who {c(_PLOTS)}.",
    lambda c, r: "How is {} different from {}? Give an example of each.".format(*c(_PAIRS)),
    lambda c, r: f"I want to get better at {c(_SUBJECTS)}. Make me a simple plan for the next {r.randint(2, 4)} weeks.",
    lambda c, r: f"What are {r.randint(3, 6)} things to do {c(_SITUATIONS)}?",
    lambda c, r: f"How do I make {c(_FOODS)}? Tell me what I need, then the steps.",
    lambda c, r: f"Why do {c(_PHENOMENA)}?",
    lambda c, r: f"Write a Python function that {c(_CODE)}, and explain how it works.",
    lambda c, r: f"Describe a normal working day of {c(_JOBS)}.",
    lambda c, r: f"Summarise the key ideas of {c(_SUBJECTS)} in {r.randint(3, 5)} bullet points.",
    lambda c, r: f"Write a product description for {c(_THINGS)}.",
    lambda c, r: f"What are the advantages and disadvantages of {c(_SUBJECTS)}?",
    lambda c, r: f"Give me {r.randint(3, 5)} questions to test my knowledge of {c(_SUBJECTS)}, with answers.",
    lambda c, r: f"My friend thinks {c(_SUBJECTS)} is boring. How could I make it sound interesting?",
]


def composed_prompts(n: int, seed: int = 0, exclude: Collection[str] = ()) -> list[list[dict[str, str]]]:
    """``n`` distinct conversations (an optional system message, then the user's request), none whose request
    is in ``exclude``; the same ``seed`` gives the same list, and a longer list starts with a shorter one."""
    rng = random.Random(f"compose:{seed}")
    out: list[list[dict[str, str]]] = []
    seen: set[str] = set(exclude)
    for _ in range(n * 50):
        if len(out) == n:
            break
        text = rng.choice(_TASKS)(rng.choice, rng) + rng.choice(_CONSTRAINTS)
        system = rng.choice(_SYSTEMS)
        if text in seen:
            continue
        seen.add(text)
        user = {"role": "user", "content": text}
        out.append([{"role": "system", "content": system}, user] if system else [user])
    return out
