#!/usr/bin/env python
"""Build the task set that ``lattice bench`` ships with: ``src/lattice_inference/tasks/grounded.jsonl``.

Every grounded document is text that ships with the running Python (``inspect.getsource`` of specific stdlib
functions, docstrings, ``keyword.kwlist``, ``http.HTTPStatus``, module docstrings), so the file is reproducible:
the same Python gives the same file (run ``python tools/build_task_set.py``; ``--out`` to write elsewhere). The
prompts are simple and explicit because the default model (SmolLM2-135M-Instruct) is small.

One JSON object per line:

- ``id``: short unique slug; ``set``: ``"grounded"`` (answer from a supplied document) or ``"chat"`` (no document);
- ``kind``: ``edit`` (output an edited copy of a real function: rename, type hints, docstring, fix a planted bug),
  ``extract`` (copy a docstring/function/paragraph, list names), ``convert`` (dict/JSON/YAML/CSV/Markdown table),
  ``summarise`` (a module's or class's docstring), ``qa`` (question answered by the document), ``multi_turn``
  (document in the first user turn, an assistant reply, a follow-up in the last user turn) or ``chat``;
- ``source``: where the text came from, e.g. ``"json.dumps (Lib/json/__init__.py)"``, or ``"handwritten"``;
- ``messages``: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` ending with a ``user`` message
  (meant for the tokenizer's chat template with ``add_generation_prompt=True``);
- ``reference`` (optional): the expected answer where it is well defined (a converted table, a copied function).
"""

from __future__ import annotations

import argparse
import collections
import colorsys
import csv
import difflib
import fnmatch
import functools
import heapq
import http
import inspect
import io
import json
import keyword
import queue
import re
import shlex
import statistics
import string
import subprocess
import sysconfig
import textwrap
import zipfile
from pathlib import Path

SYSTEM = "You are a helpful assistant. Use only the text the user gives you."
CHAT_SYSTEM = "You are a helpful, friendly assistant. Answer clearly and briefly."
OUT = Path(__file__).resolve().parents[1] / "src" / "lattice_inference" / "tasks" / "grounded.jsonl"


def where(obj) -> str:
    """``"qualname (Lib/relative/path.py)"`` for a stdlib object."""
    path = Path(inspect.getsourcefile(obj)).resolve().relative_to(Path(sysconfig.get_paths()["stdlib"]).resolve())
    name = obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{obj.__qualname__}"
    return f"{name} (Lib/{path.as_posix()})"


def src(obj) -> str:
    return textwrap.dedent(inspect.getsource(obj)).rstrip()


def doc(obj, limit: int = 2600) -> str:
    """The docstring, cut at a paragraph boundary below ``limit`` characters."""
    text = inspect.getdoc(obj)
    while len(text) > limit:
        text = text[: text.rstrip().rfind("\n\n")].rstrip()
    return text


def py(code: str) -> str:
    return f"```python\n{code}\n```"


def task(tid, kind, source, user, reference=None, *, history=(), system=SYSTEM, group="grounded") -> dict:
    messages = [{"role": "system", "content": system}]
    for i, turn in enumerate(history):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    messages.append({"role": "user", "content": user})
    out = {"id": tid, "set": group, "kind": kind, "source": source, "messages": messages}
    if reference is not None:
        out["reference"] = reference
    return out


def rename(code: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def edit_tasks() -> list[dict]:
    hls, hsv, med, dedent = (
        src(colorsys.rgb_to_hls),
        src(colorsys.rgb_to_hsv),
        src(statistics.median),
        src(textwrap.dedent),
    )
    no_doc = re.sub(r'\n    """.*?"""', "", src(shlex.split), count=1, flags=re.S)
    no_comments = "\n".join(x for x in dedent.splitlines() if not x.lstrip().startswith("#"))
    edits = [  # (id, object, code shown, instruction, expected code or None)
        (
            "rename-var-rgb-to-hls",
            colorsys.rgb_to_hls,
            hls,
            "Rename the variable `sumc` to `total` everywhere in the function. Change nothing else.",
            rename(hls, "sumc", "total"),
        ),
        (
            "rename-func-median",
            statistics.median,
            med,
            "Rename the function `median` to `middle_value`. Keep the body and the docstring exactly the same.",
            med.replace("def median(", "def middle_value(", 1),
        ),
        (
            "type-hints-fnmatch-filter",
            fnmatch.filter,
            src(fnmatch.filter),
            "Add type hints: `names` is a `list[str]`, `pat` is a `str`, and the function returns a `list[str]`.",
            None,
        ),
        (
            "type-hints-indent",
            textwrap.indent,
            src(textwrap.indent),
            "Add type hints to the parameters `text` (str) and `prefix` (str) and the return type (str). Keep everything else.",
            None,
        ),
        (
            "docstring-shlex-split",
            shlex.split,
            no_doc,
            "The function has no docstring. Add a one-line docstring that says what it does. Keep the code the same.",
            None,
        ),
        (
            "docstring-siftdown",
            heapq._siftdown,
            src(heapq._siftdown),
            "Add a short docstring under the `def` line explaining that it moves the item at `pos` up towards `startpos`. Keep the code.",
            None,
        ),
        (
            "fix-bug-rgb-to-hsv",
            colorsys.rgb_to_hsv,
            hsv.replace("maxc = max(r, g, b)", "maxc = min(r, g, b)"),
            "This function has a bug: the variable `maxc` should hold the largest of r, g and b, but it uses `min`. Fix the bug by using `max` for `maxc`.",
            hsv,
        ),
        (
            "fix-bug-median",
            statistics.median,
            med.replace("n = len(data)", "n = len(data) + 1"),
            "This function has a bug: `n` should be `len(data)`, but one is added to it. Fix the bug so that `n = len(data)`.",
            med,
        ),
        (
            "remove-comments-dedent",
            textwrap.dedent,
            dedent,
            "Remove every comment line (lines starting with `#`). Keep all the code and the docstring.",
            no_comments,
        ),
    ]
    return [
        task(
            f"edit-{tid}",
            "edit",
            where(obj),
            f"Here is a Python function:\n\n{py(code)}\n\n{what} Output the full edited function in a ```python block.",
            None if ref is None else py(ref),
        )
        for tid, obj, code, what, ref in edits
    ]


def paragraph_with(text: str, word: str) -> str:
    return next(p for p in text.split("\n\n") if word in p)


def extract_tasks() -> list[dict]:
    run, tw, dumps, dedent = doc(subprocess.run), doc(textwrap.TextWrapper), src(json.dumps), src(textwrap.dedent)
    funcs = [colorsys.rgb_to_yiq, colorsys.yiq_to_rgb, colorsys.rgb_to_hsv]
    excerpt = "\n\n\n".join(src(f) for f in funcs)
    three = "\n\n\n".join(src(f) for f in (colorsys.yiq_to_rgb, colorsys.rgb_to_hls, colorsys.hls_to_rgb))
    methods = [queue.Queue.qsize, queue.Queue.empty, queue.Queue.full, queue.Queue.put_nowait, queue.Queue.get_nowait]
    qsrc = "\n\n".join(src(f) for f in methods)
    body = dumps[dumps.index('"""', dumps.index('"""') + 3) + 3 :].lstrip("\n")
    return [
        task(
            "extract-docstring-dedent",
            "extract",
            where(textwrap.dedent),
            f"Here is a Python function:\n\n{py(dedent)}\n\nCopy the docstring of this function exactly, without "
            f"the code.",
            inspect.getdoc(textwrap.dedent),
        ),
        task(
            "extract-code-without-docstring-dumps",
            "extract",
            where(json.dumps),
            f"Here is a Python function:\n\n{py(dumps)}\n\nCopy the code that comes after the docstring, exactly "
            f"as written, in a ```python block.",
            py(body),
        ),
        task(
            "extract-param-names-dumps",
            "extract",
            where(json.dumps),
            f"Here is a Python function:\n\n{py(dumps)}\n\nList the names of all its parameters, one per line, in "
            f"order.",
            "\n".join(inspect.signature(json.dumps).parameters),
        ),
        task(
            "extract-function-names-colorsys",
            "extract",
            "colorsys (Lib/colorsys.py)",
            f"Here is an excerpt of a Python module:\n\n{py(excerpt)}\n\nList the names of all the functions "
            f"defined in this excerpt, one per line.",
            "\n".join(f.__name__ for f in funcs),
        ),
        task(
            "extract-function-hls-to-rgb",
            "extract",
            "colorsys (Lib/colorsys.py)",
            f"Here is an excerpt of a Python module:\n\n{py(three)}\n\nCopy the function `hls_to_rgb` exactly as "
            f"it is, in a ```python block.",
            py(src(colorsys.hls_to_rgb)),
        ),
        task(
            "extract-method-queue-full",
            "extract",
            "queue.Queue (Lib/queue.py)",
            f"Here is an excerpt of a Python class:\n\n{py(qsrc)}\n\nCopy the method `full` exactly "
            f"as it is, in a ```python block.",
            py(src(queue.Queue.full)),
        ),
        task(
            "extract-timeout-paragraph-run",
            "extract",
            where(subprocess.run),
            f'Copy the paragraph that begins with "If timeout is given" from the text below, word for word.\n\n{run}',
            paragraph_with(run, "If timeout is given"),
        ),
        task(
            "extract-attributes-textwrapper",
            "extract",
            where(textwrap.TextWrapper),
            f"Documentation of `textwrap.TextWrapper`:\n\n{tw}\n\nList the names of all the attributes described "
            f"(the word at the start of each entry), one per line.",
            "\n".join(re.findall(r"^  (\w+) \(", tw, re.M)),
        ),
    ]


def table(rows: list[dict], fmt: str) -> str:
    keys = list(rows[0])
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, keys, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue().rstrip()
    if fmt == "yaml":
        return "\n".join("- " + "\n  ".join(f"{k}: {json.dumps(r[k])}" for k in keys) for r in rows)
    head = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(head + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


def convert_tasks() -> list[dict]:
    status = [{"code": s.value, "phrase": s.phrase, "description": s.description} for s in http.HTTPStatus]
    ok = [s for s in status if 200 <= s["code"] < 210]
    client = [{"code": s["code"], "phrase": s["phrase"]} for s in status if 400 <= s["code"] < 420]
    redirect = [{"code": s["code"], "phrase": s["phrase"]} for s in status if 300 <= s["code"] < 310]
    mods = [difflib, heapq, shlex, colorsys, statistics, fnmatch, textwrap, zipfile, csv, string]
    modrows = [{"module": m.__name__, "summary": inspect.getdoc(m).splitlines()[0].strip()} for m in mods]
    kwrows = [{"keyword": k, "length": len(k), "first_letter": k[0]} for k in keyword.kwlist[:12]]
    http_src = "http.HTTPStatus (Lib/http/__init__.py)"
    mapping = {r["code"]: r["phrase"] for r in client}
    literal = "STATUS = {\n" + "".join(f'    {k}: "{v}",\n' for k, v in mapping.items()) + "}"
    return [
        task(
            "convert-http-4xx-dict-to-json",
            "convert",
            http_src,
            f"Here is a Python dictionary:\n\n{py(literal)}\n\nConvert it to JSON, with all "
            f"{len(mapping)} entries. Output only the JSON in a ```json block.",
            f"```json\n{json.dumps({str(k): v for k, v in mapping.items()}, indent=2)}\n```",
        ),
        task(
            "convert-http-4xx-yaml-to-json",
            "convert",
            http_src,
            f"Convert this YAML to JSON: a list with one object for each of the {len(client)} entries. Output only "
            f"the JSON in a ```json block.\n\n```yaml\n{table(client, 'yaml')}\n```",
            table(client, "json"),
        ),
        task(
            "convert-http-2xx-json-to-md",
            "convert",
            http_src,
            f"Convert this JSON to a Markdown table with the columns code, phrase and description, one row per "
            f"object.\n\n```json\n{table(ok, 'json')}\n```",
            table(ok, "md"),
        ),
        task(
            "convert-http-3xx-json-to-csv",
            "convert",
            http_src,
            f"Convert this JSON to CSV. Start with the header line `code,phrase`, then one line per object.\n\n"
            f"```json\n{table(redirect, 'json')}\n```",
            table(redirect, "csv"),
        ),
        task(
            "convert-modules-md-to-csv",
            "convert",
            "first docstring lines of 10 stdlib modules",
            f"Here is a Markdown table:\n\n{table(modrows, 'md')}\n\nConvert it to CSV. Start with the header line "
            f"`module,summary`, then one line per row. Output only the CSV.",
            table(modrows, "csv"),
        ),
        task(
            "convert-keywords-md-to-json",
            "convert",
            "keyword.kwlist (Lib/keyword.py)",
            f"Here is a Markdown table:\n\n{table(kwrows, 'md')}\n\nConvert it to a JSON list with one object per "
            f"row ({len(kwrows)} objects) with the keys keyword, length and first_letter. Output only the JSON.",
            table(kwrows, "json"),
        ),
    ]


def summarise_tasks() -> list[dict]:
    items = [
        (difflib.SequenceMatcher, "class"),
        (json, "module"),
        (heapq, "module"),
        (statistics, "module"),
        (subprocess.run, "function"),
        (textwrap.TextWrapper, "class"),
    ]
    return [
        task(
            f"summarise-{obj.__name__.lower()}",
            "summarise",
            where(obj),
            f"Here is the documentation of the Python {what} `{obj.__name__}`:\n\n{doc(obj)}\n\nSummarise this "
            f"documentation in three short sentences.",
        )
        for obj, what in items
    ]


QA = [  # (id, object, question, reference)
    (
        "qa-run-check",
        subprocess.run,
        "What exception is raised if check is true and the exit code is non-zero?",
        "CalledProcessError",
    ),
    ("qa-dumps-skipkeys", json.dumps, "What happens when ``skipkeys`` is true?", None),
    ("qa-loads-object-hook", json.loads, "What is ``object_hook`` called with?", None),
    ("qa-lru-cache-maxsize", functools.lru_cache, "What happens if maxsize is set to None?", None),
    ("qa-textwrapper-width", textwrap.TextWrapper, "What is the default width?", None),
    ("qa-zipfile-modes", zipfile.ZipFile, "Which letters can be used for the mode argument?", None),
]


def qa_tasks() -> list[dict]:
    return [
        task(
            tid,
            "qa",
            where(obj),
            f"Read this documentation of `{obj.__name__}`:\n\n{doc(obj)}\n\nAnswer using the documentation: {q}",
            ref,
        )
        for tid, obj, q, ref in QA
    ]


def multi_turn_tasks() -> list[dict]:
    quote, wrap, dumps = src(shlex.quote), src(textwrap.wrap), doc(json.dumps)
    ok = [{"code": s.value, "phrase": s.phrase} for s in http.HTTPStatus if 300 <= s.value < 310]
    nt, seq = doc(collections.namedtuple), doc(difflib.SequenceMatcher)
    return [
        task(
            "multi-rename-shlex-quote",
            "multi_turn",
            where(shlex.quote),
            "Now rename the parameter `s` to `text` everywhere and output the full function in a ```python block.",
            py(rename(quote, "s", "text")),
            history=[
                f"What does this function do?\n\n{py(quote)}",
                "It returns a shell-escaped version of the string `s`, wrapping it in single quotes when it contains unsafe characters.",
            ],
        ),
        task(
            "multi-wrap-type-hints",
            "multi_turn",
            where(textwrap.wrap),
            "Now add the type hints `text: str` and `width: int = 70` and the return type `list[str]`, and output "
            "the full function in a ```python block.",
            history=[
                f"Here is a function from the textwrap module:\n\n{py(wrap)}\n\nWhat is its name?",
                "The function is called `wrap`.",
            ],
        ),
        task(
            "multi-dumps-indent",
            "multi_turn",
            where(json.dumps),
            'Now copy, word for word, the paragraph that starts with "If ``indent`` is a non-negative integer".',
            paragraph_with(dumps, "``indent``"),
            history=[
                f"Documentation of `json.dumps`:\n\n{dumps}\n\nWhat does this function return?",
                "It serializes ``obj`` to a JSON formatted ``str``.",
            ],
        ),
        task(
            "multi-http-3xx-csv",
            "multi_turn",
            "http.HTTPStatus (Lib/http/__init__.py)",
            "Good. Now give the same data as CSV with a header line `code,phrase`.",
            table(ok, "csv"),
            history=[
                f"Here is a JSON list of HTTP status codes:\n\n{table(ok, 'json')}\n\nHow many entries are there?",
                f"There are {len(ok)} entries.",
            ],
        ),
        task(
            "multi-namedtuple-example",
            "multi_turn",
            where(collections.namedtuple),
            "Copy the lines of the example that start with `>>>`, exactly as written.",
            "\n".join(x for x in nt.splitlines() if x.startswith(">>>")),
            history=[
                f"Documentation of `collections.namedtuple`:\n\n{nt}\n\nWhat does namedtuple return?",
                "It returns a new subclass of tuple with named fields.",
            ],
        ),
        task(
            "multi-sequencematcher-ratio",
            "multi_turn",
            where(difflib.SequenceMatcher),
            "What does the example say about ratio()? Quote the lines.",
            history=[
                f"Documentation of `difflib.SequenceMatcher`:\n\n{seq}\n\nWhat is this class for?",
                "It compares pairs of sequences of any type, as long as the elements are hashable.",
            ],
        ),
    ]


CHAT = [
    (
        "chat-explain-recursion",
        "Explain what recursion is in programming. Give a simple example with a function that computes a factorial, and say what a base case is and why a recursive function needs one.",
    ),
    (
        "chat-poem-autumn",
        "Write a short poem of eight lines about autumn leaves falling in a quiet park. Use simple words and make the last two lines rhyme.",
    ),
    (
        "chat-advice-sleep",
        "I have trouble falling asleep at night because I keep thinking about work. Can you give me five practical tips to sleep better? Keep each tip to one or two sentences.",
    ),
    (
        "chat-explain-photosynthesis",
        "Explain photosynthesis to a ten-year-old. What do plants need, what do they make, and why is it important for people and animals?",
    ),
    (
        "chat-story-robot",
        "Tell me a short story, about one paragraph long, about a small robot who learns to paint pictures of the sea. Give the robot a name.",
    ),
    (
        "chat-compare-lists-tuples",
        "What is the difference between a list and a tuple in Python? When should I use one or the other? Please give a short example of each.",
    ),
    (
        "chat-advice-learning",
        "I want to learn a new language, like Spanish, in my free time. How should I start, and how much time should I spend each day? Give me a simple plan for the first month.",
    ),
    (
        "chat-explain-internet",
        "How does the internet work? Explain in simple terms what happens when I type a website address into my browser and press enter.",
    ),
    (
        "chat-recipe-pancakes",
        "Give me a simple recipe for pancakes. List the ingredients first, then the steps, numbered. I only have a frying pan and a bowl.",
    ),
    (
        "chat-explain-gravity",
        "Why do things fall down instead of up? Explain gravity in a few sentences, and mention who first described it with a law.",
    ),
    (
        "chat-email-thanks",
        "Write a short email to my colleague Sam to thank them for helping me finish a report on time. Keep it friendly and under one hundred words.",
    ),
    (
        "chat-ideas-weekend",
        "Suggest five fun things to do on a rainy weekend at home with two children aged six and eight. One sentence each.",
    ),
    (
        "chat-explain-git",
        "What is git, and why do programmers use it? Explain what a commit and a branch are, in plain words.",
    ),
    ("chat-haiku-coffee", "Write three haiku about a morning cup of coffee. Each haiku has three lines."),
]


def chat_tasks() -> list[dict]:
    return [task(tid, "chat", "handwritten", q, system=CHAT_SYSTEM, group="chat") for tid, q in CHAT]


def build() -> list[dict]:
    tasks = (
        edit_tasks()
        + extract_tasks()
        + convert_tasks()
        + summarise_tasks()
        + qa_tasks()
        + multi_turn_tasks()
        + chat_tasks()
    )
    ids = [t["id"] for t in tasks]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert all(t["messages"][-1]["role"] == "user" for t in tasks)
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    tasks = build()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        for t in tasks:
            fh.write(json.dumps(t, ensure_ascii=False) + "\n")
    print(f"wrote {len(tasks)} tasks to {args.out}")


if __name__ == "__main__":
    main()
