"""Build ``src/lattice_inference/tasks/agentic.jsonl``: multi-request traces of agentic and repeated work, from text
that ships with Python (stdlib sources, ``http.HTTPStatus``, ``keyword``), for ``lattice bench --traces``.

Each line is one trace: ``{"id", "kind", "conversation", "requests": [{"messages": [...]}, ...]}``. With
``conversation`` true, each request is sent after every earlier request's messages and the model's answers to
them (an agent's growing context); otherwise each request stands alone (an agent re-sending a file). Run with the
Python whose stdlib text should be used; the shipped file was built with Python 3.11.

    python tools/build_agentic_traces.py > src/lattice_inference/tasks/agentic.jsonl
    python tools/build_agentic_traces.py --long-document > bench/long_document_trace.jsonl
"""

from __future__ import annotations

import http
import inspect
import json
import keyword
import string
import sys
import textwrap

SYSTEM = {"role": "system", "content": "You are a coding agent. Use only the text the user gives you."}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def edit_loop() -> dict:
    """Read a stdlib function, edit it, re-read the file and edit again (each request re-sends the source)."""
    source = inspect.getsource(textwrap.TextWrapper._split)
    asks = [
        "Rename the local variable `chunks` to `pieces` and return the whole function.",
        "Add a one-line comment above the return statement and return the whole function.",
        "Rename the parameter `text` to `source_text` and return the whole function.",
        "Replace the docstring with a one-line summary and return the whole function.",
        "Return the whole function unchanged, then list its local variables.",
        "Rename the local variable `chunks` to `parts` and return the whole function.",
        "Remove the comments and return the whole function.",
        "Rename `chunks` to `tokens` and return the whole function.",
    ]
    requests = [
        {"messages": [SYSTEM, user(f"File textwrap.py, method TextWrapper._split:\n\n```python\n{source}```\n\n{ask}")]}
        for ask in asks
    ]
    return {"id": "edit-loop-textwrap", "kind": "edit-loop", "conversation": False, "requests": requests}


def edit_conversation() -> dict:
    """One conversation editing a function turn after turn (the agent's earlier answers stay in context)."""
    source = inspect.getsource(textwrap.dedent)
    turns = [
        f"Here is textwrap.dedent:\n\n```python\n{source}```\n\nRewrite it with the variable `margin` renamed to "
        "`indent`. Return the whole function.",
        "Now also rename `lines` to `rows`. Return the whole function again.",
        "Add type hints to the signature. Return the whole function again.",
        "Show the function once more, unchanged.",
        "Remove the comment lines. Return the whole function again.",
        "Show the final function once more.",
    ]
    return {
        "id": "edit-conversation-dedent",
        "kind": "edit-conversation",
        "conversation": True,
        "requests": [{"messages": [SYSTEM, user(turns[0])]}] + [{"messages": [user(t)]} for t in turns[1:]],
    }


def json_qa() -> dict:
    """Questions in turns over one JSON document (each request re-sends it, as a tool result would be)."""
    doc = json.dumps([{"code": s.value, "phrase": s.phrase} for s in http.HTTPStatus if 400 <= s.value < 420], indent=1)
    questions = [
        "Which entry has code 404? Answer with the JSON object.",
        "Which entry has code 403? Answer with the JSON object.",
        "List the entries with codes 400 to 405 as a JSON array.",
        "Which entry has code 418? Answer with the JSON object.",
        "List every phrase, one per line.",
        "Which entry has code 409? Answer with the JSON object.",
        "List the entries with codes 410 to 415 as a JSON array.",
        "Which entry has code 401? Answer with the JSON object.",
        "Return the whole document unchanged.",
        "Which entry has code 408? Answer with the JSON object.",
    ]
    requests = [{"messages": [SYSTEM, user(f"Tool result (http_status.json):\n{doc}\n\n{q}")]} for q in questions]
    return {"id": "json-qa-http-status", "kind": "json-qa", "conversation": False, "requests": requests}


def sql_schema() -> dict:
    """SQL generated against one schema in a conversation."""
    schema = (
        "CREATE TABLE keyword (name TEXT PRIMARY KEY, soft INTEGER NOT NULL);\n"
        "CREATE TABLE status (code INTEGER PRIMARY KEY, phrase TEXT NOT NULL, description TEXT);\n"
        "CREATE TABLE request (id INTEGER PRIMARY KEY, path TEXT NOT NULL, status_code INTEGER REFERENCES "
        "status(code), keyword_name TEXT REFERENCES keyword(name), created_at TEXT NOT NULL);\n"
    )
    asks = [
        "Write a SQL query that counts requests per status code.",
        "Write a SQL query that lists the paths of requests whose status code is 404.",
        "Write a SQL query that counts requests per status phrase, joining status.",
        "Write a SQL query that lists requests created after '2024-01-01' with their status phrase.",
        "Write a SQL query that lists the soft keywords used by requests.",
        "Write a SQL query that counts requests per keyword name, joining keyword.",
        "Write a SQL query that lists the ten most recent requests with their status phrase.",
    ]
    first = user(f"Schema:\n```sql\n{schema}```\n\n{asks[0]}")
    return {
        "id": "sql-schema",
        "kind": "sql",
        "conversation": True,
        "requests": [{"messages": [SYSTEM, first]}] + [{"messages": [user(a)]} for a in asks[1:]],
    }


def tool_echo() -> dict:
    """A tool's output comes back as the next turn's input: the agent lists, then works on, the same names."""
    names = ", ".join(keyword.kwlist)
    soft = ", ".join(keyword.softkwlist)
    turns = [
        f"Tool `python -c 'import keyword; print(keyword.kwlist)'` printed:\n{names}\n\nRepeat the list, one per line.",
        f"Tool printed the same list again:\n{names}\n\nWhich of them are also used in loops? Name them.",
        f"Tool `print(keyword.softkwlist)` printed:\n{soft}\n\nRepeat both lists, the hard keywords first.",
        f"Tool printed:\n{names}\n\nSort the keywords by length, one per line.",
        f"Tool printed:\n{names}\n\nRepeat the list in its original order.",
    ]
    return {
        "id": "tool-echo-keywords",
        "kind": "tool-echo",
        "conversation": True,
        "requests": [{"messages": [SYSTEM, user(turns[0])]}] + [{"messages": [user(t)]} for t in turns[1:]],
    }


def regenerate() -> dict:
    """The same question asked again (retries and regenerated answers), with small changes."""
    doc = inspect.getdoc(json.dumps)
    base = f"Documentation of json.dumps:\n\n{doc}\n\n"
    asks = [
        "Explain the `indent` parameter.",
        "Explain the `indent` parameter.",
        "Explain the `indent` parameter.",
        "Explain the `sort_keys` parameter.",
        "Explain the `indent` parameter.",
        "Explain the `sort_keys` parameter.",
    ]
    requests = [{"messages": [SYSTEM, user(base + a)]} for a in asks]
    return {"id": "regenerate-json-dumps", "kind": "regenerate", "conversation": False, "requests": requests}


def long_document() -> dict:
    """Questions in turn over one long document (the ``string`` module's source, about 2800 tokens of SmolLM2's
    tokenizer): a conversation whose context stays past 1024 tokens (`bench/long_document_trace.jsonl`)."""
    source = inspect.getsource(string)
    turns = [
        f"File string.py:\n\n```python\n{source}```\n\nWhat does the function `capwords` do? Quote its code.",
        "Which constants does the module define? List them with their values.",
        "Show the method `Template.substitute` as it appears in the file.",
        "Which class does `Formatter.vformat` belong to? Quote its first lines.",
        "Quote the docstring at the top of the file.",
    ]
    return {
        "id": "long-document-string",
        "kind": "long-document",
        "conversation": True,
        "requests": [{"messages": [SYSTEM, user(turns[0])]}] + [{"messages": [user(t)]} for t in turns[1:]],
    }


def main() -> None:
    if sys.argv[1:] == ["--long-document"]:
        print(json.dumps(long_document()))
        return
    for trace in (edit_loop(), edit_conversation(), json_qa(), sql_schema(), tool_echo(), regenerate()):
        print(json.dumps(trace))


if __name__ == "__main__":
    main()
