"""`DecodeOptions`: the method, its draft settings and the sampling, validated once.

The API (`Generator`), the CLI (``lattice generate``) and ``lattice bench`` all build one of these; every
invalid value raises `ConfigError` naming it, before any model is loaded or any token generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from lattice_inference.errors import ConfigError
from lattice_inference.sampling import SamplingOptions

#: Reference limit: ``draft_length`` counts the target's own token, so 8 means at most 7 MTP drafts.
MAX_DRAFT_LENGTH = 8
MIN_DRAFT_LENGTH = 2
#: Each method and the drafters it asks, in order of preference.
METHOD_DRAFTERS: dict[str, tuple[str, ...]] = {
    "greedy": (),
    "ngram": ("ngram",),
    "mtp": ("mtp",),
    "ngram+mtp": ("ngram", "mtp"),
    "suffix": ("suffix",),
    "suffix+mtp": ("suffix", "mtp"),
}
METHODS = tuple(METHOD_DRAFTERS)
#: ``lattice bench``'s methods without ``--methods``: on prompts (the MTP ones where the model has a head), on
#: traces (``--traces``), and in the engine comparison on prompts (``--engine local,vllm``).
DEFAULT_BENCH_METHODS = ("greedy", "ngram", "mtp", "ngram+mtp")
DEFAULT_TRACE_METHODS = ("greedy", "ngram", "suffix")
DEFAULT_COMPARE_METHODS = ("greedy", "ngram")

#: Which earlier occurrence prompt lookup copies: the leftmost (vLLM's and transformers' choice) or the latest.
MatchPolicy = Literal["first", "recent"]
MATCH_POLICIES: tuple[MatchPolicy, ...] = ("first", "recent")

#: Largest ``max_draft``, ``max_ngram`` and ``min_ngram`` a server request may ask for (a request is untrusted input).
REQUEST_LENGTH_LIMIT = 64

#: Most runners-up verified beside a draft in one round, by default (``max_leaves``: 0..`MAX_LEAVES_LIMIT`).
MAX_LEAVES = 4
MAX_LEAVES_LIMIT = 16

#: Default token budget of the earlier sequences' caches a target keeps for the prefix cache (``prefix_budget``):
#: None, sized at start from the available memory (`targets.memory.auto_budget`); SmolLM2-135M in bfloat16 takes
#: 23 KB a token, Qwen2.5-0.5B's float16 cache 12 KB, Llama 3 8B 131 KB.
PREFIX_BUDGET: int | None = None

#: The budget where the available memory is unknown.
PREFIX_BUDGET_FALLBACK = 8192

#: Default bound on a prompt cache folder's files, in MiB (``prompt_cache_size``; `targets.prompt_store`).
PROMPT_CACHE_SIZE = 4096

#: Shortest n-gram prompt lookup tries under a grammar (structured output), whatever ``min_ngram`` says: a grammar's
#: fixed spans repeat token for token (``":`` then ``"`` before every string value), so a one-token context predicts
#: well there (bench/RESULTS.md, session 32: ``ngram`` 1.62x constrained greedy against 1.49x with 2, 12 tasks).
GRAMMAR_MIN_NGRAM = 1

#: Default token budget of a suffix index (about 20 MB).
SUFFIX_BUDGET = 262_144

#: ``lattice serve --suffix-scope``: which requests share a suffix index (see `lattice_inference.serve.tenants`).
SUFFIX_SCOPES = ("tenant", "shared", "request")

#: ``forward``: ``lean`` (our decoder loop over the model's modules), ``transformers`` (the model's forward), or
#: ``auto`` (lean where it applies; see `lattice_inference.targets.lean`).
FORWARDS = ("auto", "lean", "transformers")

#: ``kv_cache``/``--kv-cache``: how the lean forward stores keys and values. ``model``: in the model's dtype.
#: ``float16``: IEEE half precision, each value rounded to nearest once as it is written and widened exactly as it is
#: read, attention computed in float32 as before; half the bytes each step reads, which at a few hundred tokens of
#: context is a third of a batched step's time. Only for float32 activations where the native ops run. ``auto``
#: (default): ``float16`` for a GGUF file run as stored (its quantized products take float32 activations), as
#: llama.cpp stores its cache for such files by default, else ``model``. Every forward of a target, plain decoding
#: included, uses the same cache, so speculation stays token for token plain decoding's.
KV_CACHES = ("auto", "model", "float16")

#: ``--dtype``/``dtype=``: the weights' dtype. ``auto`` is bfloat16 on a GPU and on a CPU the checkpoint's own (a
#: GGUF file's Q8_0/Q4_0/Q4_1 weights as stored, the rest float32, where our quantized products run; else
#: bfloat16 where bfloat16 products run without emulation, else float32); see `models.load.torch_dtype` and
#: `models.load.keeps_quantized`. ``float32``/``bfloat16`` dequantize a GGUF file.
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")

#: ``lattice serve --max-batch``: most generations running at once, their rounds sharing each forward (continuous
#: batching, `lattice_inference.batching`); 1 runs requests one at a time, in arrival order.
MAX_BATCH = 8

#: Most rows a batched step feeds (every running generation's pending token first; drafts share the rest).
MAX_BATCH_ROWS = 64

#: A long prompt joining a batch is taken in by chunks that share steps with the running generations' rounds
#: (`batching.Batch`): a chunk holds as many rows as a forward of at most `PROMPT_CHUNK_STEPS` one-token forwards'
#: cost (the target's measured costs), between `PROMPT_CHUNK_MIN` and `PROMPT_CHUNK_MAX` rows (`PROMPT_CHUNK` where
#: no costs were measured), and `PROMPT_CHUNK_MAX` rows where no generation decodes beside it; so a stream keeps
#: moving while another client's document arrives.
PROMPT_CHUNK_STEPS = 16
PROMPT_CHUNK_MIN = 32
PROMPT_CHUNK = 256
PROMPT_CHUNK_MAX = 1024

#: Seconds ``lattice serve`` lets running generations finish after SIGTERM/SIGINT (``--shutdown-timeout``): under
#: the 30 s that process managers (Kubernetes, systemd) commonly wait before they kill.
SHUTDOWN_TIMEOUT = 10.0


def needs_mtp_head(method: str) -> bool:
    """Whether ``method`` drafts with the model's MTP head."""
    return "mtp" in METHOD_DRAFTERS.get(method, ())


def parse_methods(text: str | None, default: tuple[str, ...]) -> list[str]:
    """The comma-separated methods of ``text`` (None: ``default``), greedy, the reference, first and always there;
    `ConfigError` naming unknown ones. ``lattice bench`` and the engine comparison read ``--methods`` with it."""
    methods = [m.strip() for m in text.split(",") if m.strip()] if text is not None else list(default)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    return ["greedy", *(m for m in methods if m != "greedy")]


def check_positive(name: str, value: object) -> None:
    """``value`` (of the option ``name``) must be an int >= 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


def check_ngram_range(min_ngram: int, max_ngram: int) -> None:
    """The n-gram lengths tried: both ints >= 1, ``min_ngram <= max_ngram`` (the error's ``param`` names
    ``min_ngram``, so the server can point at it)."""
    check_positive("max_ngram", max_ngram)
    check_positive("min_ngram", min_ngram)
    if min_ngram > max_ngram:
        raise ConfigError(
            f"min_ngram ({min_ngram}) is larger than max_ngram ({max_ngram}); n-grams are tried from max_ngram "
            f"down, so min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})",
            param="min_ngram",
        )


def check_match(match: str) -> None:
    """``match`` must be one of `MATCH_POLICIES`."""
    if match not in MATCH_POLICIES:
        raise ConfigError(f"match must be one of {', '.join(map(repr, MATCH_POLICIES))}; got {match!r}")


def check_draft_length(draft_length: int) -> None:
    """The reference's MTP draft length counts the target's own token: `MIN_DRAFT_LENGTH`..`MAX_DRAFT_LENGTH`."""
    low, high = MIN_DRAFT_LENGTH, MAX_DRAFT_LENGTH
    if isinstance(draft_length, bool) or not isinstance(draft_length, int) or not low <= draft_length <= high:
        raise ConfigError(f"draft_length counts the target token and must be {low}..{high}, got {draft_length!r}")


def check_draft_vocab(draft_vocab: int | None) -> None:
    """``draft_vocab`` (None: the whole vocabulary) must be a positive count of token ids."""
    if draft_vocab is None:
        return
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1:
        raise ConfigError(f"draft_vocab must be a positive number of token ids or None, got {draft_vocab!r}")


def check_max_leaves(max_leaves: int) -> None:
    """``max_leaves`` must be an integer 0..`MAX_LEAVES_LIMIT`."""
    if isinstance(max_leaves, bool) or not isinstance(max_leaves, int) or not 0 <= max_leaves <= MAX_LEAVES_LIMIT:
        raise ConfigError(f"max_leaves must be an integer 0..{MAX_LEAVES_LIMIT}, got {max_leaves!r}")


def check_prefix_budget(budget: int | None) -> None:
    """``prefix_budget`` must be a number of tokens >= 0, or None (from the available memory)."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"prefix_budget must be a number of tokens >= 0, got {budget!r}")


def check_kv_slots(slots: int) -> None:
    """``kv_slots`` must be a number of sequences >= 0."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise ConfigError(f"kv_slots must be a number of sequences >= 0, got {slots!r}")


def check_budget(budget: int) -> None:
    """A suffix index budget is a positive number of tokens."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"suffix_budget must be a number of tokens >= 1, got {budget!r}")


def check_forward(forward: str) -> None:
    """``forward`` must be one of `FORWARDS`."""
    if forward not in FORWARDS:
        raise ConfigError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")


def check_kv_cache(kv_cache: str) -> None:
    """``kv_cache`` must be one of `KV_CACHES`."""
    if kv_cache not in KV_CACHES:
        raise ConfigError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")


def check_shutdown_timeout(seconds: float) -> None:
    """``--shutdown-timeout`` must be a finite number of seconds >= 0 (0: end running generations at once)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < float("inf"):
        raise ConfigError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {seconds!r}")


def check_max_batch(value: int, name: str = "max_batch") -> int:
    """``max_batch`` (``--max-batch``: ``name``) must be 1..`MAX_BATCH_ROWS` generations at once: every running
    generation feeds at least its pending token into a batched step's rows. Returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH_ROWS:
        raise ConfigError(f"{name} must be 1..{MAX_BATCH_ROWS} (the rows of a step), got {value!r}")
    return value


def check_suffix_scope(mode: str) -> None:
    """``--suffix-scope`` must be one of `SUFFIX_SCOPES`."""
    if mode not in SUFFIX_SCOPES:
        raise ConfigError(f"--suffix-scope must be one of {', '.join(SUFFIX_SCOPES)}, got {mode!r}")


@dataclass(frozen=True)
class TargetFields:
    """The fields that build a target, defined once: `TargetOptions` keys targets by them, `DecodeOptions` takes
    them beside the per-request ones (its documentation says what each does)."""

    forward: str = "auto"
    prefix_cache: bool = True
    prefix_budget: int | None = PREFIX_BUDGET
    kv_cache: str = "auto"
    kv_slots: int = 0
    prompt_cache: str | None = None
    prompt_cache_size: int = PROMPT_CACHE_SIZE

    def __post_init__(self) -> None:
        check_forward(self.forward)
        check_prefix_budget(self.prefix_budget)
        if isinstance(self.prompt_cache_size, bool) or not isinstance(self.prompt_cache_size, int):
            raise ConfigError(f"prompt_cache_size must be a number of MiB, got {self.prompt_cache_size!r}")
        if self.prompt_cache_size < 1:
            raise ConfigError(f"prompt_cache_size must be at least 1 MiB, got {self.prompt_cache_size}")
        check_kv_cache(self.kv_cache)
        check_kv_slots(self.kv_slots)


@dataclass(frozen=True)
class TargetOptions(TargetFields):
    """What builds a target and tells two targets apart (`targets.target_for`; the server keeps one target per
    value): the `TargetFields` and ``decode_matched`` (`DecodeOptions`'s ``batched_verify``, negated: every verified
    row bit for bit the 1-token step's). The rest of `DecodeOptions` is per generator or per request: it never
    changes the target."""

    decode_matched: bool = True


@dataclass(frozen=True)
class DecodeOptions(TargetFields):
    """How to decode: ``method`` (``greedy``: plain decoding, the reference output; ``ngram``: prompt lookup;
    ``mtp``: the model's MTP head; ``ngram+mtp``: prompt lookup where an n-gram matches, the head otherwise;
    ``suffix``: continuations from earlier requests' prompts and outputs as well as this one's, a cross-request
    suffix index; ``suffix+mtp``: that, the head where it finds nothing), the draft settings, and the default
    `SamplingOptions` of each generation.

    ``suffix_budget`` bounds the suffix index in tokens (default 262144, about 20 MB): past it the oldest tokens
    are evicted, whole earlier requests first. A `Generator` keeps one index for all its generations; ``lattice
    serve`` one per tenant, each under this budget, and the tenants' indexes together under it too.

    ``max_ngram``/``min_ngram`` bound the n-gram lengths tried (longest first), ``max_draft`` the most tokens verified
    per round (default 10; with ``adaptive`` the planner verifies fewer where that pays), ``match`` which
    earlier occurrence is copied (``first``, as vLLM and transformers, or
    ``recent``); ``adaptive`` (default) lets the draft planner verify fewer than ``max_draft`` tokens per round,
    or none, from the acceptance seen so far and the target's measured verification cost. For MTP,
    ``draft_length`` counts the target's token as the reference does (2..8): each round drafts up to
    ``draft_length - 1`` tokens; ``draft_vocab=N`` drafts only among token ids ``0..N-1``;
    ``coupled_draft`` (default) makes the head draft with the same keyed noise the target samples with, so its
    drafts follow the sampled text rather than its argmax (no effect at temperature 0). ``max_leaves`` caps the
    head's runners-up the planner may verify beside its drafts in one round (a draft tree, on attention models
    without sliding windows; 0: never). ``batched_verify`` runs each verification forward over all its rows at
    once with the model's own kernels instead of decode-matched (each row bit for bit the 1-token step's): faster
    where those kernels change their rounding with the row count, but then not guaranteed identical to plain
    decoding (see `lattice_inference.kernels.decode_matched`). ``forward``: ``lean`` runs the decoder loop from the
    model's own modules without transformers' per-call plumbing (Llama, Qwen2, Qwen3; same logits, bit for bit),
    ``transformers`` the model's own forward, ``auto`` (default) lean where it applies. ``prefix_cache`` (default
    on) lets a prefill keep the cached rows of its prompt's longest prefix that the previous generation on the same
    target left (its prompt and output: the next turn of a conversation, the same document or system prompt),
    where those rows are bit for bit what the prefill would compute (the lean forward's native layer loop, prompts
    of any length; `lattice_inference.targets.prefix_reuse`); elsewhere it computes every row as before.
    Beside the live cache, earlier sequences' caches are kept for it, least recently used dropped first, up to
    ``prefix_budget`` tokens in all (default None: half the memory available at start, in tokens of the model's
    keys and values, `targets.memory`; 0: the live one only), and dropped early where the machine runs low.
    ``kv_cache``: one of `KV_CACHES` (default ``auto``: float16 keys and values for a GGUF file run as stored, else
    the model's dtype). ``kv_slots``: where the lean forward runs, preallocate the caches of that many
    sequences, each as long as the model's positions, allocated once with fixed addresses (what a captured GPU graph
    replays; `targets.kv_cache.CacheSlots`); live sequences and those kept for ``prefix_cache`` share them, the
    least recently kept dropped to free one. 0 (default): each sequence's cache grows as it needs.
    ``prompt_cache``: a folder where the lean forward saves each ended sequence's prompt rows and from which a
    later process's prefill takes them (a document asked about again; used only where its files were computed
    under this very model file, dtype, thread count and kernels, else refused with one line;
    `lattice_inference.targets.prompt_store`), its files held under ``prompt_cache_size`` MiB (default 4096).
    """

    method: str = "ngram"
    max_ngram: int = 5
    min_ngram: int = 2
    max_draft: int = 10
    match: MatchPolicy = "first"
    draft_length: int = 4
    draft_vocab: int | None = None
    coupled_draft: bool = True
    adaptive: bool = True
    max_leaves: int = MAX_LEAVES
    suffix_budget: int = SUFFIX_BUDGET
    batched_verify: bool = False
    sampling: SamplingOptions = field(default_factory=SamplingOptions)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        check_ngram_range(self.min_ngram, self.max_ngram)
        check_positive("max_draft", self.max_draft)
        check_match(self.match)
        check_draft_length(self.draft_length)
        check_draft_vocab(self.draft_vocab)
        check_max_leaves(self.max_leaves)
        check_budget(self.suffix_budget)
        super().__post_init__()
        if not isinstance(self.sampling, SamplingOptions):
            raise ConfigError(f"sampling must be a SamplingOptions, got {type(self.sampling).__name__}")

    @property
    def target(self) -> TargetOptions:
        """The target these options build (`TargetOptions`)."""
        shared = {f.name: getattr(self, f.name) for f in fields(TargetFields)}
        return TargetOptions(decode_matched=not self.batched_verify, **shared)

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters this method asks, in order of preference."""
        return METHOD_DRAFTERS[self.method]

    @property
    def needs_mtp_head(self) -> bool:
        """Whether this method drafts with the model's MTP head (a `Generator` then needs one)."""
        return needs_mtp_head(self.method)

    def updated(self, **changes: object) -> DecodeOptions:
        """A copy with ``changes`` (field names of this class or of `SamplingOptions`), validated again."""
        sampling_names = {f.name for f in fields(SamplingOptions)}
        own_names = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - sampling_names - own_names)
        if unknown:
            raise ConfigError(f"unknown decoding option(s): {', '.join(unknown)}")
        sampling = {k: v for k, v in changes.items() if k in sampling_names}
        own = {k: v for k, v in changes.items() if k in own_names}
        if sampling:
            own["sampling"] = replace(own.get("sampling", self.sampling), **sampling)  # type: ignore[type-var]
        return replace(self, **own)  # type: ignore[arg-type]
