"""Built-in chat prompts for self-distillation (the model answers them; the head learns from its own answers).

Made from templates and topics, then, past that pool, composed by `prompt_composer`; none from the benchmark sets
(``tasks/grounded.jsonl`` and the bundled model's ``eval_prompts.jsonl``): prompts whose text appears there are
dropped.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from lattice_inference.train.prompt_composer import composed_prompts

_TOPICS = [
    "volcanoes",
    "the water cycle",
    "black holes",
    "bees",
    "the moon landing",
    "electric cars",
    "rainbows",
    "the human heart",
    "tides",
    "earthquakes",
    "dinosaurs",
    "the printing press",
    "vaccines",
    "solar panels",
    "clouds",
    "the pyramids",
    "magnets",
    "whales",
    "snowflakes",
    "the stock market",
    "compound interest",
    "hash tables",
    "binary search",
    "sorting algorithms",
    "unit tests",
    "HTTP cookies",
    "databases",
    "regular expressions",
    "the command line",
    "object-oriented programming",
    "APIs",
    "encryption",
    "passwords",
    "spreadsheets",
    "time zones",
    "the metric system",
    "fractions",
    "prime numbers",
    "probability",
    "climate",
    "recycling",
    "composting",
    "gardening",
    "bicycles",
    "trains",
    "airplanes",
    "lighthouses",
    "the ocean floor",
    "deserts",
    "rainforests",
    "mountains",
    "rivers",
    "friendship",
    "teamwork",
    "public speaking",
    "saving money",
    "cooking rice",
    "baking bread",
    "making tea",
    "running",
    "yoga",
    "chess",
    "music scales",
    "painting with watercolours",
    "photography",
    "libraries",
    "museums",
    "maps",
    "compasses",
    "the alphabet",
    "birds migrating",
    "octopuses",
    "ants",
    "cats",
    "dogs",
]
_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Write a short poem about {t}.",
    "Give me a few tips for learning about {t}.",
    "Describe {t} to a child in a few sentences.",
    "Why is {t} important? Answer in one paragraph.",
    "Write a short story that involves {t}.",
    "What are the pros and cons of {t}?",
    "Summarise what most people should know about {t}.",
    "Write a limerick about {t}.",
    "List five questions a student might ask about {t}, with short answers.",
    "How would you explain {t} to a friend who has never heard of it?",
]
_OTHERS = [
    "Hi! How are you today?",
    "What can you help me with?",
    "Tell me a joke about computers.",
    "What is the capital of France, and what is it famous for?",
    "Write a polite message declining an invitation to a party.",
    "How do I make a to-do list that I actually follow?",
    "What should I pack for a weekend camping trip?",
    "Write a Python function that reverses a string, and explain it.",
    "Write a Python function that checks whether a number is even.",
    "How do I read a file line by line in Python?",
    "What is the difference between a for loop and a while loop?",
    "Suggest three names for a small bakery.",
    "Write a birthday message for my grandmother.",
    "How can I stay focused while studying?",
    "What is a good morning routine?",
    "Explain what a variable is in programming.",
    "Give me a simple recipe for a vegetable soup.",
    "What are some good habits for healthy eating?",
    "Write a thank-you note to a teacher.",
    "How do plants grow from seeds?",
]


def benchmark_texts() -> set[str]:
    """Every user message of the packaged benchmark prompt sets (kept out of training)."""
    root = Path(__file__).resolve().parent.parent
    texts: set[str] = set()
    for path in (root / "tasks" / "grounded.jsonl", root / "default_model" / "eval_prompts.jsonl"):
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                texts.update(m["content"].strip() for m in rec.get("messages", []))
                if "prompt" in rec:
                    texts.add(str(rec["prompt"]).strip())
    return texts


def builtin_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` distinct chat conversations, none from a benchmark: first the template x topic pool (shuffled by
    ``seed``, about 900), then requests composed by `prompt_composer` (varied kinds, lengths and system
    prompts). A longer list starts with a shorter one, so a self-distillation cache stays valid when ``n``
    grows."""
    pool = [tpl.format(t=t) for tpl, t in itertools.product(_TEMPLATES, _TOPICS)] + _OTHERS
    held = benchmark_texts()
    pool = [p for p in pool if p not in held]
    random.Random(seed).shuffle(pool)
    fixed = [[{"role": "user", "content": p}] for p in pool[:n]]
    return fixed + composed_prompts(n - len(fixed), seed, exclude=held | set(pool))
