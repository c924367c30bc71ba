"""Natural copy prompts for the bundled demonstration model: a source file it never saw, then its first lines again.

The bundled model was trained on the standard library with a ``# ---- copy ----`` marker between an excerpt and
its repeat; these prompts have no marker, and their files come from third-party packages installed beside this
project (never part of its training data). Each prompt is the first ``--chars`` characters of a file, a blank
line, then the file's first ``--lines`` lines again; the reference continuation is what follows those lines in
the file. Written to ``bench/natural_copy_prompts.jsonl`` (``kind`` = ``natural-copy``)::

    python bench/make_natural_copy_prompts.py [--packages gguf packaging idna] [--count 24]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path


def source_files(package: str) -> list[Path]:
    """The package's ``.py`` files of at least 1,500 characters, sorted by path."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(p for p in root.rglob("*.py") if p.stat().st_size >= 1500)


def prompt_of(path: Path, chars: int, lines: int) -> dict[str, str]:
    text = path.read_text(encoding="utf-8")
    excerpt = text[:chars]
    head = "".join(text.splitlines(keepends=True)[:lines])
    return {
        "kind": "natural-copy",
        "source": f"{path.parent.name}/{path.name}",
        "prompt": f"{excerpt}\n\n{head}",
        "reference_continuation": text[len(head) : len(head) + 1200],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", nargs="+", default=["gguf", "packaging", "idna", "certifi", "filelock"])
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--chars", type=int, default=1600)
    ap.add_argument("--lines", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).parent / "natural_copy_prompts.jsonl"))
    args = ap.parse_args()
    files = [f for pkg in args.packages if importlib.util.find_spec(pkg) for f in source_files(pkg)]
    step = max(1, len(files) // args.count)
    rows = [prompt_of(f, args.chars, args.lines) for f in files[::step][: args.count]]
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts from {len(files)} files to {args.out}")


if __name__ == "__main__":
    main()
