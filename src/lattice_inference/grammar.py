"""Structured output: a grammar's token masks over every row a round verifies (llguidance).

A `Grammar` is a JSON schema, a regular expression or a Lark grammar compiled once for one tokenizer; each request
gets its own `GrammarState` (a matcher over the tokens it has emitted). The decode loop (`SpeculativeDecoder`) uses
it three ways, none of which changes what plain constrained decoding emits:

- every row a round verifies is masked as plain constrained decoding masks its one row: row ``i`` of a round that
  feeds ``[pending, d1 .. dk]`` chooses from the tokens the grammar allows after the emitted tokens and ``d1 .. di``
  (`row_masks`), so each row's choice is plain decoding's at that index, greedy or sampled with the same seed;
- a draft is cut before its first token the grammar rejects (`valid_prefix`): such a token could never be chosen,
  so it is never verified;
- where the drafter proposes nothing, the tokens the grammar forces (`forced`: the only allowed continuation, a
  closing brace, a field name in a fixed order) are drafted instead; a masked row has a single choice there, so they
  are accepted whenever the grammar forces them, greedy or sampled.

Why llguidance (`bench/bench_grammar_engines.py`, RESULTS session 30): MIT, no dependencies, a mask in about 10 us
per token on SmolLM2's 49k vocabulary (0.2 % of a decode step), compiles a schema in under 2 ms, and offers what
speculation needs (validating a draft without consuming it, rollback, forced tokens). xgrammar's masks are faster
still but it requires torch, transformers and triton; outlines-core compiles slower and lists tokens instead of
masking them.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lattice_inference.drafters.base import Spelling
from lattice_inference.errors import ConfigError
from lattice_inference.sampling import first_max

GRAMMAR_KINDS = ("json_schema", "regex", "lark")
"""What a `Grammar` is compiled from."""
_MINUS_INFINITY = torch.tensor(float("-inf"))  # a 0-dim tensor: a scalar on any device
MAX_CACHED_GRAMMARS = 256
"""Compiled grammars a `GrammarCache` keeps (the oldest dropped first; a schema's grammar is small)."""


class GrammarError(ConfigError):
    """A schema or grammar the engine cannot compile, or a grammar used with another tokenizer."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:
        raise GrammarError("structured output needs llguidance: pip install llguidance (MIT, no dependencies)") from exc
    return llguidance


class Grammar:
    """A grammar compiled for one tokenizer (``vocab`` rows of logits: ids past the tokenizer's are never allowed).
    Make one with `for_tokenizer`; `state` gives each request its own matcher."""

    def __init__(self, tokenizer: Any, vocab: int, kind: str, source: str | Mapping[str, Any]) -> None:
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"a grammar is one of {list(GRAMMAR_KINDS)}, got {kind!r}")
        ll = _llguidance()
        self.kind, self.vocab = kind, vocab
        self._tokenizer = tokenizer
        text = source if isinstance(source, str) else json.dumps(source)
        try:
            if kind == "json_schema":
                grammar = ll.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = ll.LLMatcher.grammar_from_regex(text)
            else:
                grammar = ll.LLMatcher.grammar_from_lark(text)
        except Exception as exc:  # the engine's own message names the problem
            raise GrammarError(f"cannot compile this {kind}: {exc}") from exc
        is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(f"cannot compile this {kind}: {messages[0] if messages else 'invalid'}")
        self.source = grammar
        """The grammar in llguidance's form (what each request's matcher runs)."""

    @staticmethod
    def tokenizer_for(hf_tokenizer: Any, vocab: int) -> Any:
        """llguidance's view of a Hugging Face tokenizer (built once per tokenizer: it reads every token).

        llguidance reads every added token as a special one (bytes it never matches against text), while its masks
        still allow an added token that spells a grammar's literal: Qwen2.5's ``<tool_call>`` (added, not special)
        was allowed by the mask and then refused when consumed. So the added tokens that are not special and are
        in the model's vocabulary anyway are handed over as the ordinary text they are."""
        ll = _llguidance()
        backend = copy.copy(hf_tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        spec = json.loads(backend.to_str())
        known = spec.get("model", {}).get("vocab", {})
        if isinstance(known, dict):
            spec["added_tokens"] = [
                t for t in spec.get("added_tokens", []) if t.get("special", True) or t.get("content") not in known
            ]
        return ll.LLTokenizer(json.dumps(spec), n_vocab=vocab, eos_token=hf_tokenizer.eos_token_id)

    def state(self) -> GrammarState:
        """A new matcher at the grammar's start, for one request."""
        return GrammarState(self)


CLAUSE_ENDS = (b",", b".", b";", b"!", b"?")
"""Tokens that end a clause before a space or a line break (`GrammarState.clause_end`)."""


def _lead(data: bytes) -> bytes:
    """``data``'s leading punctuation (up to its first letter or digit): what a spelling is learned under, so that
    ``","city":"`` and ``","employer":"`` share how the model begins them."""
    for i, byte in enumerate(data):
        if chr(byte).isalnum():
            return data[:i]
    return data


class GrammarState:
    """One request's place in its grammar: the tokens it emitted so far (`advance`), the masks of a round's rows,
    and what it cost (``forced_tokens`` drafted from the grammar, ``mask_s`` spent computing masks)."""

    def __init__(self, grammar: Grammar) -> None:
        ll = _llguidance()
        self.grammar = grammar
        self._matcher = ll.LLMatcher(grammar._tokenizer, grammar.source)
        self.spelling: Spelling = grammar._tokenizer
        """The tokenizer's bytes (llguidance's view of it): what a drafter reads the history's text with."""
        if self._matcher.is_error():
            raise GrammarError(f"cannot start this {grammar.kind}: {self._matcher.get_error()}")
        self.forced_tokens = 0
        """Tokens drafted because the grammar forced them."""
        self.cut_tokens = 0
        """Drafted tokens the grammar rejected (cut from their drafts, never verified)."""
        self.spelled_tokens = 0
        """Tokens drafted as spellings of bytes the grammar forces (`_spell`)."""
        self._emitted = 0  # tokens consumed by `advance`
        self.spellings: dict[bytes, int] = {}
        """How the model spells bytes the grammar forces: their leading punctuation (`_lead`) -> the token it began
        them with (`_spell`; learned by `advance`, seeded from earlier requests by the decoder)."""
        quote = self.spelling.tokenize_bytes(b'"') if grammar.kind == "json_schema" else []
        self._quote = int(quote[0]) if len(quote) == 1 else None
        """The token spelling a JSON string's closing ``"`` alone (None: not a JSON schema, or no such token)."""
        self._spelled_at: tuple[int, bytes] | None = None  # this round's spelling: its output index, its bytes
        self.mask_s = 0.0
        """Seconds spent computing masks and telling tokens allowed without them (`_allows`)."""
        self.masks = 0
        """Masks computed (one per masked row; greedy: one per row whose argmax the mask refuses or where `_allows`
        cannot tell, `choose_greedy`)."""
        self._allowed = np.zeros((1, grammar.vocab), dtype=np.bool_)
        self._canonical = bool(self.spelling.is_canonical)
        self._eos = frozenset(int(t) for t in self.spelling.eos_tokens)
        self._scores: torch.Tensor | None = None

    def _bitmask(self) -> np.ndarray:
        """The tokens allowed now, packed: bit ``t % 8`` of byte ``t // 8`` is set where token ``t`` is."""
        return np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)

    def _allows(self, token: int) -> bool | None:
        """Whether the mask (`_bitmask`) allows ``token``, told without computing the mask (None: where that cannot
        be told, the matcher stopped or the tokenizer not canonical). llguidance's mask is, where bytes are forced
        (`compute_ff_bytes`): the first forced token alone where the forced bytes spell any (`compute_ff_tokens`),
        else the tokens that spell a beginning of the forced bytes, and those that begin with them and that the
        grammar takes (its tokenizer's trie walked from the forced bytes); where none are forced, the
        tokens the grammar takes; EOS where the grammar may end. Read after a forward on a 2-core Xeon, a mask
        costs about 190 us (median; the forward evicts llguidance's tables from the cache) and this about 60 (most
        of it llguidance's first tokenizing of the forced bytes in a new state). The equality with the mask is
        tested token by token (`tests/test_grammar.py`)."""
        matcher = self._matcher
        if not self._canonical or matcher.is_stopped():
            return None
        ahead = matcher.compute_ff_bytes()
        if ahead:
            forced = matcher.compute_ff_tokens()
            if forced:
                return token == int(forced[0])
            spelled = self.spelling.decode_bytes([token])
            if spelled and ahead.startswith(spelled):
                return True
            if token not in self._eos and not spelled.startswith(ahead):
                return False
        if token in self._eos:
            return bool(matcher.is_accepting())
        return int(matcher.validate_tokens([token])) == 1

    def _mask_into(self, row: np.ndarray, packed: np.ndarray | None = None) -> None:
        """The tokens allowed now (or by ``packed``, a `_bitmask`) into ``row`` (bools over the vocabulary: ids past
        the tokenizer's never)."""
        allowed = np.unpackbits(self._bitmask() if packed is None else packed, bitorder="little")
        n = min(row.shape[0], allowed.shape[0])
        row[:n] = allowed[:n].view(np.bool_)
        row[n:] = False

    def _check_vocab(self, vocab: int) -> None:
        """Logits of ``vocab`` columns fit this grammar (made for the model's tokenizer and vocabulary)."""
        if vocab != self.grammar.vocab:
            raise GrammarError(f"a grammar of {self.grammar.vocab} tokens for logits of {vocab}")

    def _step(self, token: int) -> int:
        """Consume ``token`` on the way to a look-ahead (`rollback` undoes it); returns the steps it took: 0 where the
        matcher had stopped already (its grammar complete, EOS consumed without a step: rolling it back would undo
        one token too many)."""
        stopped = self._matcher.is_stopped()
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} is not allowed here by the grammar")
        return 0 if stopped else 1

    def row_masks(self, draft: Sequence[int]) -> torch.Tensor:
        """The allowed tokens ``[len(draft) + 1, vocab]`` of a round's rows: row ``i`` after the emitted tokens and
        ``draft[:i]`` (every draft token must be allowed: `valid_prefix`). The state is left as it was. The rows
        live in this state's buffer: valid until its next call."""
        start = time.perf_counter()
        rows = len(draft) + 1
        if self._allowed.shape[0] < rows:  # grown once to the widest round, reused by every later one
            self._allowed = np.zeros((rows, self.grammar.vocab), dtype=np.bool_)
        self._mask_into(self._allowed[0])
        consumed = 0
        try:
            for i, token in enumerate(draft, 1):
                consumed += self._step(token)
                self._mask_into(self._allowed[i])
        finally:
            if consumed:
                self._matcher.rollback(consumed)
        self.mask_s += time.perf_counter() - start
        self.masks += rows
        return torch.from_numpy(self._allowed[:rows])

    def constrain(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:
        """``logits`` (``[len(draft) + 1, vocab]``, a round's rows) with the tokens each row's mask (`row_masks`)
        disallows at minus infinity, in float32, in this state's buffer (valid until its next call: a round's
        choice is made from it at once; no megabyte allocated and freed per round)."""
        masks = self.row_masks(draft)
        start = time.perf_counter()
        rows, vocab = logits.shape
        self._check_vocab(vocab)
        buffer = self._scores
        if buffer is None or buffer.shape[0] < rows or buffer.device != logits.device:
            buffer = self._scores = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
        out = buffer[:rows]
        torch.where(masks.to(logits.device), logits, _MINUS_INFINITY, out=out)
        self.mask_s += time.perf_counter() - start
        return out

    def choose_greedy(self, scores: torch.Tensor, draft: Sequence[int]) -> list[int]:
        """Greedy choices of a round's rows (``scores``: ``[len(draft) + 1, vocab]``, the penalties and bias already
        applied, no mask): row ``i``'s choice is the argmax of its row masked as `constrain` masks it, without
        masking the row where that is not needed. A row's first maximum is the masked row's first maximum whenever
        the mask allows it (masking only lowers other entries to minus infinity), so only a row whose argmax the
        mask refuses is masked. Whether the mask allows it is told without the mask where `_allows` can (the mask's
        own bit decides, not the matcher: it accepts tokenizations the mask refuses, ``":`` then ``"`` where the
        mask allows only the canonical ``":"``). Rows are chosen up to the
        first that disagrees with the draft (a round emits nothing past it): no mask is computed past it, and the
        later rows are ``-1`` (a token id nothing may emit). The state is left as it was."""
        rows, vocab = scores.shape
        self._check_vocab(vocab)
        if rows != len(draft) + 1:
            raise GrammarError(f"need {len(draft) + 1} rows for a draft of {len(draft)}, got {rows}")
        best = first_max(scores)  # what greedy decoding without a grammar computes too: not the mask's cost
        start = time.perf_counter()
        choices = [-1] * rows
        consumed = 0
        try:
            for i, token in enumerate(best):
                if not self._allows(token):  # refused, or not told without the mask: the mask decides
                    packed = self._bitmask()
                    self.masks += 1
                    if not (packed[token >> 3] >> (token & 7)) & 1:
                        row = self._allowed[0]
                        self._mask_into(row, packed)
                        masked = torch.where(torch.from_numpy(row).to(scores.device), scores[i], _MINUS_INFINITY)
                        token = first_max(masked.reshape(1, -1))[0]
                choices[i] = token
                if i == len(draft) or token != draft[i]:
                    break
                consumed += self._step(token)
        finally:
            if consumed:
                self._matcher.rollback(consumed)
        self.mask_s += time.perf_counter() - start
        return choices

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here (the state does not change)."""
        return int(self._matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def forced(self, limit: int, after: Sequence[int] = (), close: bool = False) -> tuple[list[int], list[int]]:
        """What the grammar drafts after the emitted tokens and then ``after`` (tokens it allows: a valid draft), up
        to ``limit`` tokens in all: the tokens it forces (its only continuation; none where it allows a choice), then
        a spelling of the bytes it forces past them (`_spell`). With ``close`` (a JSON string ends after ``after``,
        `clause_end`): no forced tokens, a spelling of the closing quote and the bytes forced after it. The state
        does not change."""
        self._spelled_at = None
        if limit < 1:
            return [], []
        consumed = 0
        try:
            for token in after:
                consumed += self._step(token)
            if self._matcher.is_stopped():
                return [], []
            position = self._emitted + len(after)
            if close:
                assert self._quote is not None
                self._step(self._quote)  # the matcher has not stopped: one step, undone at once
                ahead = b'"' + self._matcher.compute_ff_bytes()
                self._matcher.rollback(1)
                return [], self._spell([], ahead, limit, position)
            forced = [int(t) for t in self._matcher.compute_ff_tokens()[:limit]]
            done = self.spelling.decode_bytes(forced)
            ahead = self._matcher.compute_ff_bytes()
            if len(ahead) <= len(done) or not ahead.startswith(done):
                return forced, []
            return forced, self._spell(forced, ahead[len(done) :], limit - len(forced), position + len(forced))
        finally:
            if consumed:
                self._matcher.rollback(consumed)

    def _spell(self, forced: list[int], rest: bytes, limit: int, position: int) -> list[int]:
        """Tokens for ``rest``, bytes the grammar forces past its ``forced`` tokens (which would be emitted from
        output index ``position`` on), as far as the grammar allows them, at most ``limit``. llguidance leaves a
        forced run's last token out where the bytes after it could merge into another token (``":"`` closing a key
        before a string, ``"`` opening one): the bytes are certain, their tokens are not (SmolLM2 spells ``":"`` as
        ``":`` then ``"``). So they begin with the token this request's model began the same leading punctuation
        with before (`advance` learns it), else as the tokenizer spells them, and are verified like any drafted
        token."""
        if limit < 1 or not rest:
            return []
        tokenizer = self.spelling
        guess: list[int] = []
        tail = rest
        while tail and len(guess) < limit:  # the learned leads, then the tokenizer's spelling of what is left
            first = self.spellings.get(_lead(tail))
            spelled = tokenizer.decode_bytes([first]) if first is not None else b""
            if first is None or not tail.startswith(spelled):
                guess += [int(t) for t in tokenizer.tokenize_bytes(tail)]
                break
            guess.append(first)
            tail = tail[len(spelled) :]
        guess = guess[:limit]
        allowed = int(self._matcher.validate_tokens([*forced, *guess])) - len(forced)
        self._spelled_at = (position, rest)
        return guess[: max(allowed, 0)]

    def clause_end(self, draft: Sequence[int]) -> int:
        """Where a JSON string value copied into ``draft`` (tokens the grammar allows) likely ends: the index of
        its first token that ends a clause (``,`` ``.`` ``;`` ``!`` ``?`` before a space or a line break) where
        the grammar allows closing the string instead, else ``len(draft)``. A value copied from a document runs
        on in the document past where the model ends it (`` Robotics, where`` for ``" Robotics",``); a draft
        closed at the clause's end (`forced` with ``close``) takes the next key in the same round instead of
        verifying rows the model rejects."""
        quote = self._quote
        if quote is None or len(draft) < 3:
            return len(draft)
        spell = self.spelling.decode_bytes
        for i in range(1, len(draft) - 1):
            if spell([draft[i]]) in CLAUSE_ENDS and spell([draft[i + 1]])[:1] in (b" ", b"\n"):
                if int(self._matcher.validate_tokens([*draft[:i], quote])) == i + 1:
                    return i
                return len(draft)
        return len(draft)

    def advance(self, tokens: Sequence[int]) -> None:
        """The request emitted ``tokens`` (each chosen under this grammar's mask). Where one of them begins bytes
        the grammar forced (`_spell`), how the model spelled them is kept for the next time."""
        for token in tokens:
            if not self._matcher.consume_token(int(token)):
                raise GrammarError(f"the emitted token {token} is not allowed by the grammar")
            if self._spelled_at is not None and self._spelled_at[0] == self._emitted:
                self._learn_spelling(int(token))
            self._emitted += 1

    def _learn_spelling(self, token: int) -> None:
        """The model emitted ``token`` where this round's spelled bytes went on (`_spelled_at`): where it spells
        their leading punctuation, keep it as that punctuation's spelling, and follow the bytes on to the next
        token while the model's tokens spell them."""
        assert self._spelled_at is not None
        position, rest = self._spelled_at
        spelled = self.spelling.decode_bytes([token])
        lead = _lead(rest)
        if not spelled or not rest.startswith(spelled):
            self._spelled_at = None
            return
        if len(spelled) <= len(lead):
            self.spellings[lead] = token
        tail = rest[len(spelled) :]
        self._spelled_at = (position + 1, tail) if tail else None


class GrammarCache:
    """Grammars compiled for one tokenizer, once per source (a `Generator`'s, the server engine's): llguidance's
    view of the tokenizer is built on first use (it reads every token), each grammar on its first request."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        self._ll_tokenizer: Any = None
        self._grammars: dict[tuple[str, str], Grammar] = {}

    def get(self, kind: str, source: str | Mapping[str, Any]) -> Grammar:
        """The grammar of ``kind`` (`GRAMMAR_KINDS`) from ``source`` (a JSON schema may be a dict), compiled on
        first use; `GrammarError` names a source the engine cannot compile."""
        key = (kind, source if isinstance(source, str) else json.dumps(source, sort_keys=True))
        compiled = self._grammars.get(key)
        if compiled is None:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = Grammar.tokenizer_for(self.tokenizer, self.vocab)
            compiled = Grammar(self._ll_tokenizer, self.vocab, kind, source)
            if len(self._grammars) >= MAX_CACHED_GRAMMARS:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = compiled
        return compiled

    def response_format(self, response_format: Mapping[str, Any] | None) -> Grammar | None:
        """The grammar of an OpenAI ``response_format`` (`response_format_grammar`; None for text), compiled once."""
        found = response_format_grammar(response_format)
        return None if found is None else self.get(*found)


def grammar_file(path: str | Path, kind: str) -> tuple[str, str | dict[str, Any]]:
    """``(kind, source)`` of a grammar file the CLI is given: ``kind`` ``"json_schema"`` (a JSON schema) or
    ``"grammar"`` (Lark, llguidance's dialect, or llama.cpp's GBNF, converted to Lark by llguidance's own converter:
    a file with a ``start:`` rule or ``%llguidance`` is Lark, anything else GBNF). `GrammarError` names a file that
    cannot be read or parsed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GrammarError(f"cannot read grammar file '{path}': {exc}") from exc
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise GrammarError(f"'{path}' is not a JSON schema: {exc}") from exc
        if not isinstance(schema, dict):
            raise GrammarError(f"'{path}' is not a JSON schema: a schema is a JSON object")
        return "json_schema", schema
    _llguidance()
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return "lark", any_to_lark(text)
    except Exception as exc:  # the converter's own message names the rule
        raise GrammarError(f"cannot read '{path}' as GBNF: {exc}") from exc


def response_format_grammar(response_format: Mapping[str, Any] | None) -> tuple[str, str | dict[str, Any]] | None:
    """The grammar an OpenAI ``response_format`` asks for, as ``(kind, source)``: None for ``{"type": "text"}`` (or
    none), any JSON object for ``{"type": "json_object"}``, the schema of ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}``. The schema is enforced whether ``strict`` is set or not (as
    vLLM does): a grammar's masks are the only way this server constrains output. `GrammarError` names a malformed
    one."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise GrammarError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}")
        return "json_schema", dict(schema)
    raise GrammarError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
