"""The loaded model behind the server: prompt encoding, per-request generators, and each request's `Reply`.

The weights and tokenizer are loaded once. Each distinct `DecodeOptions` (speculation settings) gets its own `Generator`
over them (a drafter, cheap to build), kept in a small LRU cache; they all verify with one shared target (one packing
of the weights, one self-check and cost measurement). Each generation runs on its own sequence of that target (its
own cache), so the `Scheduler` can run several at once, their rounds sharing each forward.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from jinja2 import TemplateError

from lattice_inference.api import Generator, mtp_head_for
from lattice_inference.errors import ConfigError, LatticeError
from lattice_inference.generation import Generation
from lattice_inference.grammar import Grammar, GrammarCache, GrammarError
from lattice_inference.metrics import GenerationMetrics
from lattice_inference.models.load import LoadedModel
from lattice_inference.mtp import MtpHead
from lattice_inference.options import DecodeOptions, TargetOptions
from lattice_inference.process import release_freed_memory
from lattice_inference.prompt_codec import PromptCodec
from lattice_inference.sampling import SamplingOptions
from lattice_inference.serve.errors import bad_request
from lattice_inference.serve.schemas import SCOPE_FIELDS, Message, Speculative
from lattice_inference.serve.stops import StopMatcher
from lattice_inference.serve.tenants import SuffixScopes
from lattice_inference.streaming import TextStream
from lattice_inference.targets import target_for
from lattice_inference.targets.base import Target
from lattice_inference.tool_calls import Tool, ToolCall, ToolCallParser, tools_grammar

#: Speculation settings whose generators the engine keeps. A generator is a drafter over the shared model and
#: target (tens of kilobytes), so keeping many is cheap.
GENERATOR_CACHE = 32

#: oneDNN primitives a server process keeps (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; oneDNN's default is 1024). Each
#: bfloat16 matmul shape (every attention length, prompt length and draft width) gets its own JIT-compiled
#: primitive of about 0.3 MB, kept in that cache, so a server's RSS grew by some 350 MB as the cache filled over
#: hundreds of requests (`bench/bench_serve_memory.py`; glibc's in-use bytes grew with it, so not fragmentation).
#: 128 holds every shape a decode step reuses; lengths not seen lately are compiled again (well under a
#: millisecond each).
ONEDNN_CACHE_CAPACITY = 128


@dataclass
class GenerationJob:
    """Everything one generation needs, validated."""

    prompt_ids: list[int]
    max_tokens: int
    settings: DecodeOptions
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stops: Sequence[str] = ()
    logprobs: int | None = None
    """How many most likely tokens to list beside each token's log-probability (None: no log-probabilities)."""
    tenant: str | None = None
    """Whose suffix index the request drafts from (`lattice_inference.serve.tenants`; None: its own tokens only)."""
    clear_index: bool = False
    """Clear the tenant's suffix index before generating."""
    grammar: Grammar | None = None
    """What the output must follow (``response_format``, or a required tool call; None: free)."""
    tool_mode: str = "none"
    """``"auto"`` or ``"required"``: the output's tool calls are parsed out of its text (`ToolCallParser`)."""
    prediction: list[int] | None = None
    """The request's predicted output as token ids (OpenAI's ``prediction``; None: none): drafted from first."""
    show_drafts: bool = False
    """Report, per round, the spans of text whose tokens came from accepted drafts (`Delta.drafted`)."""


@dataclass(frozen=True)
class LogprobEntry:
    """A token the client received, for OpenAI's ``logprobs``: its text, log-probability, the most likely tokens
    at its index (text, log-probability) and where its text starts in the completion."""

    token: str
    logprob: float
    top: list[tuple[str, float]]
    offset: int


@dataclass
class Delta:
    """Text released by one decode round (possibly empty: held back), the tokens it accepted, the
    `LogprobEntry` of each token whose text is now released (where the request asked for log-probabilities) and
    the tool calls it completed."""

    text: str
    tokens: int
    logprobs: list[LogprobEntry] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    drafted: list[tuple[int, int]] | None = None
    """Where the request asked (``show_drafts``): the spans of the generated text (character offsets, end exclusive)
    of this round's tokens that came from accepted drafts; None where not asked."""


@dataclass
class Finish:
    """The end of a generation: OpenAI's finish reason, token counts and the acceptance metrics."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    metrics: dict[str, Any]


def cap_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Bound oneDNN's primitive cache to ``capacity`` entries (see `ONEDNN_CACHE_CAPACITY`), unless the
    environment already sets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``. oneDNN reads it when it creates its first
    primitive, so this must run before the process's first forward."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def _check_text(text: str, param: str) -> None:
    """400 for text that is not valid Unicode (JSON can carry lone surrogates; tokenizers refuse them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param}: the text is not valid Unicode ({exc.reason})", param=param) from None


class Engine:
    """One loaded model served under ``name`` with default speculation ``settings`` (``mtp_head_path``: a head
    written by ``lattice train-mtp`` for the MTP methods)."""

    def __init__(
        self,
        loaded: LoadedModel,
        settings: DecodeOptions,
        *,
        name: str | None = None,
        cache_size: int = GENERATOR_CACHE,
        mtp_head_path: str | None = None,
        suffix_scope: str = "tenant",
    ) -> None:
        self.loaded = loaded
        self.suffix_scopes = SuffixScopes(settings.suffix_budget, suffix_scope)
        """The tenants' suffix indexes (``--suffix-scope``), under the default settings' ``suffix_budget``."""
        self.mtp_head_path = mtp_head_path
        self.tokenizer = loaded.tokenizer
        self.codec = PromptCodec(loaded.tokenizer, loaded.eos_token_ids)
        """The prompt encoding shared with `Generator` and the engines."""
        self.defaults = settings
        self.name = name or Path(loaded.source).name
        self.cache_size = cache_size
        self._generators: OrderedDict[DecodeOptions, Generator] = OrderedDict()
        self._targets: dict[TargetOptions, Target] = {}
        self._heads: dict[int, MtpHead] = {}
        self.mtp_error: str | None = None
        try:
            self._head(settings.draft_length)
        except LatticeError as exc:
            if settings.needs_mtp_head:
                raise
            self.mtp_error = str(exc)
        config = loaded.model.config
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.vocab_size = int(config.vocab_size)
        self.grammars = GrammarCache(loaded.tokenizer, self.vocab_size)
        """Every request's compiled grammars (``response_format``, required tool calls), by source."""

    # -- validation on the event loop, before a request is queued --------------------------------------------

    def settings_for(self, spec: Speculative | None) -> DecodeOptions:
        """The server's draft settings with the fields the request's ``speculative`` sets replaced, or a 400
        naming what cannot be served."""
        given = spec.model_dump(exclude=set(SCOPE_FIELDS)) if spec is not None else {}
        changes = {k: v for k, v in given.items() if v is not None}
        try:
            settings = self.defaults.updated(**changes)
        except ConfigError as exc:
            raise bad_request(str(exc), param="speculative" + (f".{exc.param}" if exc.param else "")) from None
        if settings.needs_mtp_head and self.mtp_error is not None:
            raise bad_request(
                f"method {settings.method!r} needs an MTP head, which this model lacks: {self.mtp_error}",
                param="speculative.method",
            )
        return settings

    def sampling_for(self, given: Mapping[str, Any]) -> SamplingOptions:
        """The request's sampling (``given``: `SamplingOptions` fields, None where unset), checked by the library
        here rather than in the worker. Unset fields take the server's (``lattice serve --temperature ...``); its
        default temperature is 0: greedy, the model's argmax text whatever the method (``top_p`` and the rest
        change nothing; penalties still apply)."""
        try:
            sampling = replace(self.defaults.sampling, **{k: v for k, v in given.items() if v is not None})
        except LatticeError as exc:
            raise bad_request(str(exc)) from None
        outside = [t for t, _ in sampling.logit_bias if t >= self.vocab_size]
        if outside:
            raise bad_request(
                f"logit_bias: token id {outside[0]} is outside the vocabulary of size {self.vocab_size}", "logit_bias"
            )
        return sampling

    def encode_chat(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> list[int]:
        """Token ids of ``messages`` through the tokenizer's chat template, ready for the assistant's turn, offering
        ``tools`` (`PromptCodec.chat_ids`)."""
        if not self.codec.has_chat_template:
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        turns = [m.turn() for m in messages]
        for i, turn in enumerate(turns):
            _check_text(turn["content"], f"messages.{i}.content")
        try:
            return self.codec.chat_ids(turns, tools)
        except TemplateError as exc:
            raise bad_request(f"the chat template refused these messages: {exc}", param="messages") from None

    def grammar_for(
        self, response_format: Mapping[str, Any] | None, tools: Sequence[Tool] = (), *, parallel: bool = True
    ) -> Grammar | None:
        """The grammar a request's output must follow: its ``response_format``'s, or where a tool call is required
        (``tools``: those it may call) the calls' (`tools_grammar`); compiled once per source. A 400 names a schema
        the engine cannot compile."""
        try:
            if tools:
                return self.grammars.get("lark", tools_grammar(tools, parallel=parallel))
            return self.grammars.response_format(response_format)
        except GrammarError as exc:
            param = "tools" if tools else "response_format"
            raise bad_request(f"{param}: {exc}", param=param) from None

    def encode_prompt(self, prompt: str | list[str] | list[int]) -> list[int]:
        """Token ids of a text completion's prompt (a string, a list of one string, or token ids)."""
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary of size {self.vocab_size}", "prompt")
            return [int(t) for t in prompt]
        text = prompt if isinstance(prompt, str) else str(prompt[0])
        _check_text(text, "prompt")
        if not text.strip():
            raise bad_request("the prompt is empty", param="prompt")
        return self.codec.text_ids(text)

    def encode_prediction(self, text: str, prompt_ids: Sequence[int]) -> list[int]:
        """Token ids of a request's ``prediction`` (OpenAI's predicted outputs), or a 400 naming ``prediction``
        where it is not valid Unicode or longer than the model's positions leave after the prompt."""
        _check_text(text, "prediction")
        ids = self.codec.continuation_ids(text)
        room = None if self.max_positions is None else self.max_positions - len(prompt_ids)
        if room is not None and len(ids) > room:
            raise bad_request(
                f"prediction: {len(ids)} tokens, more than the {room} positions this model has after the prompt's "
                f"{len(prompt_ids)} tokens",
                param="prediction",
                code="context_length_exceeded",
            )
        return ids

    def budget(
        self, prompt_ids: Sequence[int], requested: int | None, default: int | None, prompt_param: str = "prompt"
    ) -> int:
        """Tokens to generate: the request's, else ``default``, else the rest of the model's positions (256
        where the model does not say how many it has)."""
        room = None if self.max_positions is None else self.max_positions - len(prompt_ids)
        if room is not None and room < 1:
            raise bad_request(
                f"the prompt has {len(prompt_ids)} tokens; this model has {self.max_positions} positions",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            if room is None:
                return default or 256
            return room if default is None else min(default, room)
        if room is not None and requested > room:
            raise bad_request(
                f"max_tokens {requested} plus the prompt's {len(prompt_ids)} tokens exceeds this model's "
                f"{self.max_positions} positions",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    # -- generation, on the worker thread -----------------------------------------------------------------------

    def _head(self, draft_length: int) -> MtpHead:
        if draft_length not in self._heads:
            self._heads[draft_length] = mtp_head_for(
                self.loaded, draft_length, self.defaults.draft_vocab, self.mtp_head_path
            )
        return self._heads[draft_length]

    def _target(self, settings: DecodeOptions) -> Target:
        """The target for ``settings``, one per kind of verification (``batched_verify``, ``forward``), shared
        by every generator: one cache, reused by each generation (they run one at a time), and one packing of the
        weights, self-check and cost measurement, rather than one per speculation setting."""
        key = settings.target
        if key not in self._targets:
            self._targets[key] = target_for(self.loaded.model, key)
        return self._targets[key]

    def generator(self, settings: DecodeOptions) -> Generator:
        """A generator for ``settings`` over the loaded model and the shared target (built once, then reused)."""
        gen = self._generators.get(settings)
        if gen is None:
            head = self._head(settings.draft_length) if settings.needs_mtp_head else None
            gen = Generator(
                self.loaded.model,
                self.tokenizer,
                settings,
                mtp_head=head,
                eos_token_ids=self.codec.eos_token_ids,
                target=self._target(settings),
            )
            self._generators[settings] = gen
            while len(self._generators) > self.cache_size:
                self._generators.popitem(last=False)
        self._generators.move_to_end(settings)
        return gen

    def forget_tenant(self, tenant: str) -> None:
        """Drop what ``tenant``'s earlier requests left for its later ones: its suffix index, the draft planners'
        acceptance learned in its scope and the cached rows its prefills may reuse (``clear_index``)."""
        self.suffix_scopes.clear(tenant)
        for generator in self._generators.values():
            generator.decoder.forget(tenant)
        for target in self._targets.values():
            target.forget_prefix(tenant)

    def logprob_entries(self, state: Generation, text: TextStream, start: int, stop: int) -> list[LogprobEntry]:
        """The `LogprobEntry` of tokens ``start .. stop - 1`` of ``state``, each token and runner-up as its own
        decoded text (none where the request did not ask for log-probabilities)."""
        if state.top_logprobs is None:
            return []

        def piece(token: int) -> str:
            return cast(str, self.tokenizer.decode([token], skip_special_tokens=False))

        return [
            LogprobEntry(piece(lp.token), lp.logprob, [(piece(t), v) for t, v in lp.top], text.offset_of(i))
            for i, lp in enumerate(state.logprobs[start:stop], start)
        ]

    def reply(self, job: GenerationJob, on_done: Callable[[str, GenerationMetrics, str], None] | None = None) -> Reply:
        """The `Reply` of ``job``: its generation made and validated, not started (a `Scheduler` runs it)."""
        return Reply(self, job, on_done)


class Reply:
    """One request's generation as its client receives it: the `Generation` (not started: the scheduler runs its
    rounds, alone or batched), the text released past stop strings (`delta` per round), the log-probabilities of
    the released tokens, and the end (`finish`, or `cancel`). ``on_done(method, metrics, finish_reason)`` is called
    once, at the end, whichever it is (``finish_reason`` ``"cancelled"`` when cancelled)."""

    def __init__(
        self, engine: Engine, job: GenerationJob, on_done: Callable[[str, GenerationMetrics, str], None] | None
    ) -> None:
        self.engine, self.job, self.on_done = engine, job, on_done
        generator = engine.generator(job.settings)
        self.decoder = generator.decoder
        if job.clear_index and job.tenant is not None:  # a request of no tenant keeps nothing to clear
            engine.forget_tenant(job.tenant)
        index = engine.suffix_scopes.index_for(job.tenant) if "suffix" in job.settings.drafters else None
        # the planner's learned acceptance is carried within the tenant only, as its index
        self.state = self.decoder.new_generation(
            job.prompt_ids,
            job.max_tokens,
            generator.sampling(**asdict(job.sampling)),
            logprobs=job.logprobs,
            suffix_index=index,
            scope=job.tenant,
            grammar=None if job.grammar is None else job.grammar.state(),
            prediction=job.prediction,
        )
        self.owner = job.tenant
        """Whose earlier rows the prefill may reuse: the tenant's only (none for a request of no tenant), since a
        prefill's speed would otherwise tell one tenant that another sent the same text."""
        self._text, self._stops = TextStream(engine.tokenizer), StopMatcher(job.stops)
        self._tools = ToolCallParser() if job.tool_mode != "none" else None
        self._released: list[str] = []
        self._sent = 0  # tokens whose log-probabilities were sent
        self._ended = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text (the generation is not to run further)."""
        return self._stops.stopped

    def delta(self, chunk: list[int]) -> Delta:
        """The client's `Delta` for one round's tokens: the text now released (held back while it may still
        become a stop string) and the log-probabilities of the tokens it covers."""
        state, text = self.state, self._text
        start = len(text.token_ids)
        self._released.append(self._stops.push(text.push(chunk)))
        entries: list[LogprobEntry] = []
        if self.job.logprobs is not None:
            upto = text.tokens_within("".join(self._released), self._sent)
            entries, self._sent = self.engine.logprob_entries(state, text, self._sent, upto), upto
        content, calls = self._split(self._released[-1])
        drafted = self._drafted(start, len(text.token_ids)) if self.job.show_drafts else None
        return Delta(content, len(chunk), entries, calls, drafted)

    def _drafted(self, start: int, end: int) -> list[tuple[int, int]]:
        """The text spans of tokens ``start .. end - 1`` that came from accepted drafts, a run of them per span."""
        flags, text = self.state.from_draft, self._text
        spans, i = [], start
        while i < end:
            if not flags[i]:
                i += 1
                continue
            j = i
            while j < end and flags[j]:
                j += 1
            spans.append((text.offset_of(i), text.offset_of(j)))
            i = j
        return spans

    def _split(self, released: str, end: bool = False) -> tuple[str, list[ToolCall]]:
        """Released text as the client's content and the tool calls it completed (where tools were offered)."""
        if self._tools is None:
            return released, []
        content, calls = self._tools.push(released)
        if end:
            rest, more = self._tools.flush()
            content, calls = content + rest, calls + more
        return content, calls

    def finish(self) -> list[Delta | Finish]:
        """The end of a generation that ran out (EOS, length) or hit a stop string (it must not run further): the
        held-back text, the last log-probabilities, and the `Finish`."""
        state, text, stops = self.state, self._text, self._stops
        if stops.stopped:  # count what the client got, not the tokens the last round ran past the stop
            state.metrics.new_tokens = text.tokens_covering("".join(self._released))
            tail = ""
        else:
            tail = stops.push(text.flush())
            tail += stops.flush()
        rest = self.engine.logprob_entries(state, text, self._sent, state.metrics.new_tokens)
        tail, calls = self._split(tail, end=True)
        items: list[Delta | Finish] = [Delta(tail, 0, rest, calls)] if tail or rest or calls else []
        reason = "stop" if stops.stopped or state.stop_reason == "eos" else "length"
        if self._tools is not None and self._tools.calls and reason == "stop":
            reason = "tool_calls"
        self._end(reason)
        metrics = state.metrics
        details = {"method": self.job.settings.method, **metrics.to_dict()}
        if state.seed is not None:
            details["seed"] = state.seed
        items.append(Finish(reason, metrics.prompt_tokens, metrics.new_tokens, details))
        return items

    def cancel(self) -> None:
        """The end of a generation stopped early (its client went away, or the server is shutting down)."""
        self._end("cancelled")

    def _end(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        if self.on_done is not None:
            self.on_done(self.job.settings.method, self.state.metrics, reason)
        # a generation's forwards allocate and free tensors of many sizes (the cache, activations of every draft
        # width); without handing glibc's freed pages back the server's RSS creeps up with each new mix of settings
        # and lengths (`bench/bench_serve_memory.py`); well under a millisecond, once per generation
        release_freed_memory()
