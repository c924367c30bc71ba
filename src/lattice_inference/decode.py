"""The speculative decode loop: drafter -> target forward -> choices -> accepted tokens -> drafter.

Invariant: after prefill, the generation's target sequence (`Generation.sequence`, its own cache slot) holds
every token of the sequence except the newest one, the *pending* token, which sits at position
``p = sequence.length``. Each round feeds ``[pending] + draft`` in one
forward (positions ``p .. p+k``); row ``i`` of its logits chooses the token at sequence index ``p + 1 + i``
(greedy argmax, or the keyed sampler of `lattice_inference.sampling`, whose choice depends only on that row's
logits, the seed and that index). The longest draft prefix equal to those choices is accepted (``a`` tokens),
the choice after it (the correction, or the bonus) is emitted too, and the cache is rolled back to ``p + 1 + a``.
So every token is fed exactly once, at the position equal to its index, and each emitted token is exactly the
choice plain decoding makes at that index: the output is token for token plain decoding's, greedy or sampled
with the same seed. Penalties (`lattice_inference.penalties`) are applied to each row by its own history (the
emitted tokens and the draft tokens fed before it), so they keep this: an accepted row's penalised logits are
plain decoding's.

Under a grammar (structured output: `lattice_inference.grammar`) every row is masked as plain constrained decoding
masks its row, after the penalties; drafts are cut before a token the grammar rejects, and tokens it forces are
drafted, so the output is still plain constrained decoding's.

With ``adaptive`` (`Generator`'s default) a `DraftPlanner` decides each round how many drafted tokens to verify (up to
``max_draft``; 0 makes the round a plain decoding step) from the acceptance it has seen in this generation and
the target's measured forward costs; that changes only how many forwards the output takes, never the output.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TypedDict, Unpack

import torch

from lattice_inference.acceptance import AcceptanceStats
from lattice_inference.batching import Batch
from lattice_inference.draft_planner import DraftPlanner
from lattice_inference.drafters.base import Drafter, PlannedDraft
from lattice_inference.drafters.prediction import PREDICTION_PRIORS, PredictionState
from lattice_inference.drafters.suffix_index import SuffixIndex
from lattice_inference.errors import ConfigError, TokenError
from lattice_inference.generation import Generation, GenerationResult, row_logprob
from lattice_inference.grammar import GrammarState
from lattice_inference.options import MAX_LEAVES, DecodeOptions
from lattice_inference.sampling import SamplingOptions
from lattice_inference.targets.base import Segment, Target, TargetSequence
from lattice_inference.targets.exactness import exactness
from lattice_inference.targets.facts import Exactness, ForwardCosts
from lattice_inference.targets.forward_cost import forward_costs
from lattice_inference.verify import DraftTree, Verdict, verify_prefix

__all__ = ["Generation", "GenerationResult", "Round", "SpeculativeDecoder"]

_GREEDY = SamplingOptions()
MAX_SCOPES = 256
"""Most scopes whose learned acceptance a decoder keeps (the least recently used dropped first; a few KB each)."""


@dataclass
class Learned:
    """What a scope's generations leave to its next one: the last planner's acceptance statistics, and how the
    model spells the bytes grammars force (`GrammarState.spellings`: leading punctuation -> its first token)."""

    stats: AcceptanceStats | None = None
    spellings: dict[bytes, int] = field(default_factory=dict)


class RequestArgs(TypedDict, total=False):
    """What a request adds to `SpeculativeDecoder.start` (and `new_generation`) besides its prompt, budget and
    sampling: see `start`."""

    logprobs: int | None
    suffix_index: SuffixIndex | None
    scope: str | None
    grammar: GrammarState | None
    prediction: Sequence[int] | None


@dataclass(frozen=True)
class Round:
    """One planned verification round of a generation: the draft, the rows to feed (the pending token and the
    draft, or a draft tree's rows with their parents and depths) and the position of the first."""

    planned: PlannedDraft
    tokens: list[int]
    position: int
    tree: DraftTree | None = None
    parents: list[int] | None = None
    depths: list[int] | None = None


class SpeculativeDecoder:
    """Generates from a `Target`, using a `Drafter` (or none: plain decoding) to skip forwards.

    ``max_draft`` caps the tokens proposed per round; ``adaptive`` lets a `DraftPlanner` choose fewer (the
    first generation then measures the target's forward costs, once; on by default, as in `DecodeOptions`; off,
    every proposal is verified as drafted), and, where the target verifies trees and the
    drafter ranks its tokens, up to ``max_leaves`` runners-up beside them (a draft tree). ``costs`` gives the
    planner forward costs instead of measuring them (they stand as given; measured ones are corrected by each
    generation's timed forwards).
    The decoder holds no per-generation state: each call of `start` (or `stream`, `generate`) makes a new
    `Generation`, which owns its sequence on the target, so generations of one decoder may be iterated in any
    interleaving. Across generations it keeps only what its planner learned about acceptance (rates by drafter
    key, never text), per *scope*: each generation's planner starts from the previous one's of its scope
    (`lattice_inference.acceptance`; `MAX_SCOPES` most recent scopes kept; ``lattice serve`` gives each tenant its
    own).
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        *,
        max_draft: int = DecodeOptions.max_draft,
        eos_token_ids: Iterable[int] = (),
        adaptive: bool = DecodeOptions.adaptive,
        costs: ForwardCosts | None = None,
        max_leaves: int = MAX_LEAVES,
    ) -> None:
        if max_draft < 1:
            raise ConfigError(f"max_draft must be at least 1, got {max_draft}")
        self.target = target
        self.drafter = drafter
        self.max_draft = max_draft
        self.adaptive = adaptive
        self.costs = costs
        self.max_leaves = max_leaves
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.exactness: Exactness | None = None
        """The target's self-check (`prepare`, or the first drafted generation); None before, or not claimed."""
        wants_hidden = drafter is not None and drafter.uses_hidden_states
        if wants_hidden and not target.provides_hidden_states:
            why = getattr(target, "hidden_states_problem", "") or f"{type(target).__name__} cannot provide them"
            raise ConfigError(f"the MTP drafter needs the target's hidden states: {why}")
        self._wants_hidden = wants_hidden
        self._learned: OrderedDict[str, Learned] = OrderedDict()  # scope -> what its last generation learned

    def _validate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise TokenError("the prompt is empty: at least one token is needed")
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be non-negative, got {max_new_tokens}")
        self._check_vocabulary(prompt_ids, "prompt")
        limit = self.target.max_positions
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            raise TokenError(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens {max_new_tokens} = "
                f"{len(prompt_ids) + max_new_tokens} exceeds the model's {limit} positions"
            )

    def _check_vocabulary(self, ids: Sequence[int], what: str) -> None:
        """A `TokenError` naming the first of ``ids`` (``what``'s tokens) outside the target's vocabulary."""
        vocab = self.target.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise TokenError(f"{what} token {i} has id {t}, outside the vocabulary of size {vocab}")

    def new_generation(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingOptions | None = None,
        **request: Unpack[RequestArgs],
    ) -> Generation:
        """A validated `Generation` of this decoder, not started (`start` starts it alone; a
        `lattice_inference.batching.Batch` runs several in one forward). The arguments are `start`'s."""
        logprobs, scope = request.get("logprobs"), request.get("scope", "")
        prompt_ids = [int(t) for t in prompt_ids]
        self._validate(prompt_ids, max_new_tokens)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ConfigError(f"logprobs must be a number of most likely tokens >= 0, or None, got {logprobs!r}")
        gen = Generation(prompt_ids, max_new_tokens, sampling or _GREEDY, self.target.vocab_size, logprobs)
        gen.suffix_index = request.get("suffix_index")
        gen.scope = scope
        gen.grammar = request.get("grammar")
        prediction = request.get("prediction")
        if prediction:
            gen.prediction = self._checked_prediction(prediction, len(prompt_ids))
        return gen

    def _checked_prediction(self, prediction: Sequence[int], prompt_tokens: int) -> list[int]:
        """A request's prediction as token ids, or a `TokenError` naming an id outside the vocabulary or a length
        past the model's positions after the prompt."""
        ids = [int(t) for t in prediction]
        self._check_vocabulary(ids, "prediction")
        limit = self.target.max_positions
        if limit is not None and prompt_tokens + len(ids) > limit:
            raise TokenError(
                f"prediction of {len(ids)} tokens plus the prompt's {prompt_tokens} exceeds the model's {limit} "
                "positions"
            )
        return ids

    def start(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingOptions | None = None,
        **request: Unpack[RequestArgs],
    ) -> Generation:
        """Validate the request and return a `Generation` to iterate (chunks of tokens as they are accepted).

        Stops after ``max_new_tokens`` tokens or at the first EOS token (which is not emitted). ``sampling``
        defaults to greedy decoding; when it samples without a seed, a seed is drawn (``Generation.seed``).
        ``logprobs=N`` records each emitted token's log-probability and the ``N`` most likely tokens at its
        index (``Generation.logprobs``, from the rows that chose them). ``suffix_index``: the cross-request index
        the drafter may draft from and add this generation to (`Drafter.start`; None: this request only).
        ``scope``: whose learned acceptance the planner starts from and leaves its own to (the same scope's next
        generation starts from it; None: nothing carried in or out).
        """
        gen = self.new_generation(prompt_ids, max_new_tokens, sampling, **request)
        gen._chunks = self._run(gen)
        return gen

    def stream(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingOptions | None = None
    ) -> Iterator[list[int]]:
        """`start` a generation and iterate over it: chunks of generated tokens, one per verification round."""
        return iter(self.start(prompt_ids, max_new_tokens, sampling))

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingOptions | None = None
    ) -> GenerationResult:
        """Run a generation to the end and return every generated token with the metrics."""
        return self.start(prompt_ids, max_new_tokens, sampling).result()

    def _emit(self, gen: Generation, tokens: list[int], logits: torch.Tensor, path: Sequence[int]) -> list[int]:
        """Cut ``tokens`` at the budget and before the first EOS, recording why generation stops (and, where
        asked, their log-probabilities from the rows ``path`` of ``logits``, which chose them)."""
        budget = gen.max_new_tokens - gen.metrics.new_tokens
        own = len(tokens) - 1  # a round's tokens: its accepted draft, then the target's own choice
        tokens = tokens[:budget]
        for i, t in enumerate(tokens):
            if t in self.eos_token_ids:
                gen.stop_reason = "eos"
                tokens = tokens[:i]
                break
        else:
            if len(tokens) == budget:
                gen.stop_reason = "length"
        gen.metrics.new_tokens += len(tokens)
        gen.from_draft.extend(i < own for i in range(len(tokens)))
        if gen.penalties is not None:
            gen.penalties.extend(tokens)
        if gen.top_logprobs is not None:
            gen.logprobs.extend(row_logprob(logits[path[i]], t, gen.top_logprobs) for i, t in enumerate(tokens))
        return tokens

    def _run(self, gen: Generation) -> Generator[list[int], None, None]:
        """A generation alone: a `Batch` of one (the server's and `generate_many`'s driver), whose `add` opens it
        on a new sequence of the target and whose steps run its rounds (`plan`, the target's forward, `finish`)
        until it stops; closed when it ends, whatever ends it."""
        batch = Batch(self.target, max_rows=self.widest(), prompt_chunks=False)
        try:
            first = batch.add(self, gen)
            if first:
                yield first
            while len(batch):
                chunk = batch.step().get(gen, [])
                if chunk:
                    yield chunk
        finally:
            batch.close()

    def open(self, gen: Generation, owner: str | None = "", *, chunk: int = 0) -> list[int]:
        """Start ``gen`` on a new sequence of the target (`Generation.sequence`, whose prefill may reuse ``owner``'s
        earlier rows): the self-check and cost measurement where not done yet, the planner, the prefill; returns
        the first emitted tokens (`close` must follow, whatever happens: it releases the sequence).

        ``chunk`` > 0: where more than ``chunk`` prompt rows are left to compute after the reused prefix and the
        target takes a prompt in by forwards (`Target.open_prompt`), the prefill is left to the batch: the rows
        left wait in ``gen.prompt_left``, to be fed by chunks in the batch's steps beside the other generations'
        rounds, and `take_in` finishes the opening; this returns no tokens then."""
        m = gen.metrics
        if self.drafter is not None or gen.prediction:
            start = time.perf_counter()
            costs = self._calibrate()  # once per target: a no-op here where `prepare` ran at load
            m.calibration_s = time.perf_counter() - start
            if self.exactness is not None:
                m.exact, m.exactness = self.exactness.exact, self.exactness.line()
            kept = self._learned.get(gen.scope) if gen.scope is not None else None
            if kept is not None and gen.grammar is not None:
                gen.grammar.spellings.update(kept.spellings)
            if costs is not None:
                learned = kept.stats.carried() if kept is not None and kept.stats is not None else None
                priors = dict(self.drafter.key_priors) if self.drafter is not None else {}
                if gen.prediction:
                    priors.update(PREDICTION_PRIORS)
                gen.planner = DraftPlanner(costs, max_leaves=self._leaves(), learned=learned, priors=priors)
        gen.sequence = self.target.new_sequence(owner, capture_hidden=self._wants_hidden)
        gen.opening_at = time.perf_counter()
        if chunk > 0 and self._takes_in(gen, chunk):
            return []
        first, hidden, rows = self._prefill(gen)
        return self._opened(gen, first, hidden, rows)

    def _takes_in(self, gen: Generation, chunk: int) -> bool:
        """Whether ``gen``'s prompt is left to the batch's steps (see `open`): its sequence holds the reused prefix
        and ``gen.prompt_left`` the rest. Not where the drafter reads the prompt rows' hidden states, nor where
        rounds may not share forwards."""
        prompt, seq = gen.prompt_ids, _sequence(gen)
        if self._wants_hidden or not self.shares_forwards or self.rows_alone:
            return False
        kept = self.target.open_prompt(seq, prompt)
        if kept is None or len(prompt) - kept <= chunk:
            return False  # `prefill` finds the same prefix in the sequence's cache
        gen.prompt_left = list(prompt[kept:])
        gen.metrics.cached_prompt_tokens = kept
        self._start_drafter(gen)
        return True

    def take_in(self, gen: Generation, chunk: int) -> Segment:
        """The next chunk of ``gen``'s prompt (at most ``chunk`` rows) as a segment of a batched forward (its last
        row's logits only where it is the prompt's last chunk, none otherwise), taken off ``gen.prompt_left``."""
        tokens, gen.prompt_left = gen.prompt_left[:chunk], gen.prompt_left[chunk:]
        return Segment(_sequence(gen), tokens, logits=1)

    def taken_in(self, gen: Generation, logits: torch.Tensor) -> list[int]:
        """The prompt's last chunk was fed: its last row's ``logits`` choose the first token, as a prefill's do;
        returns the first emitted tokens (`open`'s)."""
        logits = logits[-1:]
        return self._opened(gen, self._first(gen, logits), None, logits)

    @staticmethod
    def _first(gen: Generation, logits: torch.Tensor) -> list[int]:
        """The first token, chosen by the prompt's last row (``logits`` ``[1, vocab]``), now pending."""
        prompt = gen.prompt_ids
        first = gen.choose(logits, prompt[-1:], len(prompt))
        gen.pending = first[-1]
        return first

    def _opened(self, gen: Generation, first: list[int], hidden: torch.Tensor | None, rows: torch.Tensor) -> list[int]:
        """The prefill ended with ``first`` (chosen by ``rows``): timed, emitted, told to the grammar and drafter."""
        gen.opened_at = time.perf_counter()
        assert gen.opening_at is not None
        gen.metrics.prefill_s = gen.opened_at - gen.opening_at
        out = self._emit(gen, first, rows, range(len(first)))
        if gen.grammar is not None:
            gen.grammar.advance(out)
        self._inform_drafter(gen, first, hidden, 0)
        return out

    def plan(
        self, gen: Generation, *, rows_left: int | None = None, shared_rows: int = 0, shared_tokens: int = 0
    ) -> Round:
        """This round of ``gen``: its draft (a chain, or a tree where the target verifies trees) and the rows to
        feed. In a batched step, ``rows_left`` caps the rows it may add, and ``shared_rows`` counts the rows of the
        other sequences in the forward and ``shared_tokens`` the tokens they surely give, which the planner weighs
        (`DraftPlanner.share`: drafts shrink as the step fills)."""
        room = gen.max_new_tokens - gen.metrics.new_tokens - 1
        if rows_left is not None:
            room = min(room, rows_left - 1)
        if gen.planner is not None:
            gen.planner.share(shared_rows, shared_tokens)
        planned = self._draft(gen, room)
        if gen.grammar is not None:  # plain decoding (no drafter) drafts nothing, not even forced tokens
            cap = min(self.max_draft, room) if gen.drafter_state is not None else 0
            planned = self._grammatical(gen.grammar, planned, cap)
        pending, position = gen.pending, _sequence(gen).length
        if planned.alternatives and self.target.verifies_trees and self.shares_forwards:  # a draft tree
            tree = DraftTree(planned.verify, planned.alternatives)
            tokens, parents, depths = tree.rows(pending)
            return Round(planned, tokens, position, tree, parents, depths)
        return Round(planned, [pending, *planned.verify], position)

    def round(self, gen: Generation) -> list[int]:
        """One round of ``gen`` alone (`plan`, the forward of its sequence, `finish`); returns the tokens it
        emits."""
        planned, seq = self.plan(gen), _sequence(gen)
        forward_start = time.perf_counter()
        if self.rows_alone:
            logits = self._token_by_token(seq, planned.tokens)
        elif planned.tree is not None:
            assert planned.parents is not None
            logits = self.target.forward_tree(seq, planned.tokens, planned.parents)
        else:
            logits = self.target.forward(seq, planned.tokens)
        seconds = time.perf_counter() - forward_start
        return self.finish(gen, planned, logits, seq.hidden, len(planned.tokens), seconds)

    @property
    def rows_alone(self) -> bool:
        """Whether this target's self-check found a chain width whose rows differ from 1-token steps: then every
        verification runs one token at a time (lossless by construction: each row is a plain decoding step; no
        faster than plain decoding)."""
        return self.exactness is not None and not self.exactness.chains_exact

    @property
    def shares_forwards(self) -> bool:
        """Whether draft trees and batched forwards may run: where the self-check found nothing that differs (a
        failed tree leaves chains only; the batched forward is checked only after everything else passed)."""
        return self.exactness is None or self.exactness.exact

    def _token_by_token(self, seq: TargetSequence, tokens: Sequence[int]) -> torch.Tensor:
        """The logits of ``tokens`` as 1-token forwards, one after another (`rows_alone`), their hidden states
        joined in ``seq.hidden`` where it captures them."""
        rows, hidden = [], []
        for token in tokens:
            rows.append(self.target.forward(seq, [token]))
            if seq.hidden is not None:
                hidden.append(seq.hidden)
        if hidden:
            seq.hidden = torch.cat(hidden)
        return torch.cat(rows)

    def finish(
        self,
        gen: Generation,
        planned: Round,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        width: int,
        seconds: float,
    ) -> list[int]:
        """Verify ``planned``'s rows against their ``logits`` (and ``hidden`` states, for a drafter that reads
        them), keep the accepted rows of ``gen``'s sequence, learn from the round and
        return the tokens it emits. ``width``: rows of the forward that ran it (more than ``planned``'s in a
        batch), which took ``seconds``."""
        sampler, target, draft = gen.sampler, self.target, planned.planned.verify
        if planned.tree is not None:
            assert planned.parents is not None and planned.depths is not None
            scores = gen.scores(logits, planned.tokens, planned.parents)
            depths = planned.depths
            verdict = planned.tree.verify(sampler.choose_at(scores, [planned.position + 1 + d for d in depths]))
        else:
            verdict = verify_prefix(draft, gen.choose(logits, planned.tokens, planned.position + 1))
        if gen.planner is not None and self.costs is None:  # given costs stand as given
            gen.planner.observe_forward_seconds(width, seconds)
        rows = self._path_hidden(hidden, verdict.path)
        target.keep_rows(_sequence(gen), planned.position, verdict.path)
        leaves = len(planned.tokens) - len(draft) - 1
        gen.metrics.record_round(len(draft), verdict.accepted, leaves=leaves, on_leaf=verdict.rows is not None)
        self._learn(gen, planned.planned, verdict)
        out = self._emit(gen, verdict.tokens, logits, verdict.path)
        if gen.grammar is not None:
            gen.grammar.advance(out)
        self._inform_drafter(gen, verdict.tokens, rows, planned.position)
        gen.pending = verdict.tokens[-1]
        return out

    def close(self, gen: Generation) -> None:
        """End ``gen`` (finished or not): release its sequence, leave what its planner learned to its scope, and
        fill in its decode time and drafter forwards."""
        m = gen.metrics
        if gen.sequence is not None:
            self.target.release(gen.sequence)
        if gen.scope is not None and (gen.planner is not None or gen.grammar is not None):
            self._keep_learned(gen.scope, gen)
        now = time.perf_counter()
        if gen.opened_at is not None:
            m.decode_s = now - gen.opened_at
        m.latency_s = now - gen.created_at
        m.drafter_forwards = gen.drafter_state.forward_count if gen.drafter_state is not None else 0
        if gen.grammar is not None:
            m.grammar_forced_tokens, m.grammar_mask_s = gen.grammar.forced_tokens, gen.grammar.mask_s
            m.grammar_cut_tokens, m.grammar_spelled_tokens = gen.grammar.cut_tokens, gen.grammar.spelled_tokens

    def _keep_learned(self, scope: str, gen: Generation) -> None:
        """Keep what ``gen`` learned for the next generation of ``scope``: its planner's acceptance statistics (or
        the last ones kept), and the spellings its grammar learned added to those kept."""
        kept = self._learned.get(scope) or Learned()
        if gen.planner is not None:
            kept.stats = gen.planner.stats
        if gen.grammar is not None:
            kept.spellings.update(gen.grammar.spellings)
        self._learned[scope] = kept
        self._learned.move_to_end(scope)
        while len(self._learned) > MAX_SCOPES:
            self._learned.popitem(last=False)

    def learned(self, scope: str = "") -> AcceptanceStats | None:
        """What the last generation of ``scope`` learned about acceptance (None: no generation of it kept)."""
        kept = self._learned.get(scope)
        return None if kept is None else kept.stats

    def forget(self, scope: str) -> None:
        """Drop what generations of ``scope`` learned (a tenant clearing what it left behind)."""
        self._learned.pop(scope, None)

    def prepare(self) -> float:
        """Run now what the first drafted generation would otherwise run before its prefill: the target's
        exactness self-check (where it is decode-matched) and, when adaptive, the measurement of its forward costs
        (unless given). Both are kept per target, so calling this at load takes them off the first request.
        Returns the seconds spent (next to nothing when already done). Both run on scratch sequences of the target.
        """
        if self.drafter is None:
            return 0.0
        start = time.perf_counter()
        self._calibrate()
        return time.perf_counter() - start

    def _calibrate(self) -> ForwardCosts | None:
        """The target's self-check (kept in `exactness`, where it is decode-matched) and, when adaptive, the
        forward costs the planner weighs; each measured once per target, before any prefill."""
        if self.target.decode_matched:
            self.exactness = exactness(self.target, self.widest())
        if not self.adaptive:
            return None
        return self.costs or forward_costs(self.target, self.widest())

    @staticmethod
    def _grammatical(grammar: GrammarState, planned: PlannedDraft, cap: int) -> PlannedDraft:
        """``planned`` under a grammar: the draft cut before its first token the grammar rejects (never verified),
        no tree (its leaves would need masks of their own paths), and the tokens the grammar forces after what is
        left (up to ``cap`` in all): a closing quote and the next key after a value copied from the prompt."""
        valid = planned.verify[: grammar.valid_prefix(planned.verify)]
        grammar.cut_tokens += len(planned.verify) - len(valid)
        end, full = grammar.clause_end(valid), len(valid)
        valid = valid[:end]
        forced, spelled = grammar.forced(cap - len(valid), after=valid, close=end < full)
        if not forced and not spelled:
            return replace(planned, verify=valid, alternatives=[])
        grammar.forced_tokens += len(forced)
        grammar.spelled_tokens += len(spelled)
        tokens = [*valid, *forced, *spelled]
        return replace(planned, proposal=tokens, verify=tokens, alternatives=[], runners_up=[])

    def _leaves(self) -> int:
        """Most tree leaves a round may verify (0 where the target or the drafter cannot use them)."""
        trees = self.drafter is not None and self.drafter.proposes_trees
        return self.max_leaves if self.target.verifies_trees and trees and self.shares_forwards else 0

    def widest(self) -> int:
        """The widest forward a round may run: the pending token, ``max_draft`` drafted tokens and the leaves."""
        return self.max_draft + 1 + self._leaves()

    def _draft(self, gen: Generation, room: int) -> PlannedDraft:
        """This round's draft (at most ``room`` tokens fit the budget), from the generation's drafter state:
        without a planner the whole proposal is verified; with one, the drafter plans it
        (`DrafterState.propose_planned`)."""
        state = gen.drafter_state
        cap = min(self.max_draft, room)
        if state is None or cap < 1:
            return PlannedDraft([], [])
        if gen.planner is None:
            proposal = state.propose(cap)
            tokens = proposal[:cap]
            return PlannedDraft(tokens, tokens, proposal.key)
        return state.propose_planned(cap, gen.planner)

    @staticmethod
    def _learn(gen: Generation, planned: PlannedDraft, verdict: Verdict) -> None:
        """Feed one round's outcome to the planner: the verified draft, the first token of each proposal passed
        over (it would have been accepted if it is the round's first emitted token), and, where the draft failed
        at a depth whose runners-up were ranked, whether they would have held."""
        planner = gen.planner
        if planner is None:
            return
        depth = verdict.on_draft
        planner.record(planned.proposal, len(planned.verify), depth, verdict.tokens[depth], planned.key)
        for tokens, key in planned.skipped:
            planner.record(tokens, 0, 0, verdict.tokens[0], key)
        if depth < len(planned.runners_up) and planned.proposal[depth] != verdict.tokens[depth]:
            planner.record_runners_up(planned.runners_up, depth, verdict.tokens[depth], planned.key)

    def _prefill(self, gen: Generation) -> tuple[list[int], torch.Tensor | None, torch.Tensor]:
        """Prefill the prompt; return the first emitted tokens, (if wanted) the prompt's hidden states, and the
        logits rows that chose the tokens.

        The prefill's last row chooses the token at index ``len(prompt)``. Where the target can verify a draft
        inside the prefill forward and the drafter needs no hidden states, the first draft is proposed from the
        prompt alone and verified there (rows choose indices ``len(prompt) ..``), saving one forward.
        """
        target, prompt, seq = self.target, gen.prompt_ids, _sequence(gen)
        self._start_drafter(gen)
        budget = gen.max_new_tokens
        fused = target.fuses_prefill_and_draft and gen.grammar is None
        if gen.drafter_state is None or self._wants_hidden or not fused or budget < 2:
            logits = target.prefill(seq, prompt).unsqueeze(0)
            gen.metrics.cached_prompt_tokens = seq.reused
            return self._first(gen, logits), self._path_hidden(seq.hidden, len(prompt)), logits
        planned = self._draft(gen, budget - 1)
        draft = planned.verify
        logits = target.prefill_with_draft(seq, prompt, draft)
        verdict = verify_prefix(draft, gen.choose(logits, [prompt[-1], *draft], len(prompt)))
        target.rollback(seq, len(prompt) + verdict.accepted)
        self._learn(gen, planned, verdict)
        if draft:
            gen.metrics.record_round(len(draft), verdict.accepted, in_prefill=True)
        gen.pending = verdict.tokens[-1]
        return verdict.tokens, None, logits

    def _start_drafter(self, gen: Generation) -> None:
        """The drafter's state for ``gen`` (`Drafter.start` on its prompt), where it drafts; where the request
        brings a prediction, a `PredictionState` following it ahead of the method's state."""
        state = None
        if self.drafter is not None:
            state = self.drafter.start(gen.prompt_ids, sampler=gen.sampler, suffix_index=gen.suffix_index)
        if gen.prediction:
            state = PredictionState(gen.prediction, state)
        gen.drafter_state = state
        if state is not None and gen.grammar is not None:
            state.under_grammar(gen.grammar.spelling)

    def _path_hidden(self, hidden: torch.Tensor | None, rows: int | list[int]) -> torch.Tensor | None:
        """The rows of a forward's ``hidden`` states (the first ``rows``, or those listed: an accepted path), if
        the drafter wants them."""
        if not self._wants_hidden:
            return None
        assert hidden is not None
        if isinstance(rows, int):
            return hidden[:rows]
        return hidden[: len(rows)] if rows == list(range(len(rows))) else hidden[rows]

    @staticmethod
    def _inform_drafter(gen: Generation, tokens: list[int], hidden: torch.Tensor | None, position: int) -> None:
        """Hand accepted tokens (and the target hiddens of the positions that produced them) to the generation's
        drafter state."""
        state = gen.drafter_state
        if state is None:
            return
        state.extend(tokens)
        if hidden is not None:
            state.observe(hidden, position)
        if isinstance(state, PredictionState):  # counted as each round ends: a server reports them at the end
            gen.metrics.accepted_prediction_tokens = state.accepted
            gen.metrics.rejected_prediction_tokens = state.rejected


def _sequence(gen: Generation) -> TargetSequence:
    """The target sequence of an opened generation."""
    if gen.sequence is None:
        raise RuntimeError("this generation has not been opened (SpeculativeDecoder.open)")
    return gen.sequence
