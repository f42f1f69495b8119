"""Real speculative rollouts, recorded round by round, for evaluation and calibration.

Nothing here re-implements decoding: prompts go through the engine from `build_engine` exactly as in
generation, with the drafter wrapped so that each round's `Draft` (tokens and per-position
confidences) is captured. The verdict of a round is read from `GenerationStats`, whose
`accepted_per_round` gets one entry per round in order, so round i's draft is paired with entry i.

For DSpark drafters the *raw* confidence logits (before any calibration temperature) are captured as
well: Sequential Temperature Scaling fits temperatures to them, and recomputing them from c_k would
lose precision where the sigmoid saturates.
"""

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark.drafters.base import Draft, Drafter
from dspark.engine import Request
from dspark.factory import build_engine
from dspark.loading import LoadedTarget
from dspark.sampling import SamplingParams, make_generator
from dspark.stats import GenerationStats
from dspark.text import eos_token_ids, prompt_ids


@dataclass
class RoundRecord:
    """One verified round. `confidence` (c_k) and `raw_logits` (uncalibrated confidence logits z_k)
    cover the verified drafts 1..drafted, or are None when the drafter has no confidence head."""

    drafted: int
    accepted: int
    confidence: list[float] | None = None
    raw_logits: list[float] | None = None
    dataset: str = ""

    @property
    def conditional_outcomes(self) -> list[int]:
        """Outcome of each position k that was reached (1..k-1 accepted): 1 if draft k survived too."""
        reached = min(self.drafted, self.accepted + 1)
        return [int(k < self.accepted) for k in range(reached)]

    @property
    def cumulative_outcomes(self) -> list[int]:
        """For every verified position k: 1 if drafts 1..k all survived (what a_k predicts)."""
        return [int(k < self.accepted) for k in range(self.drafted)]

    @property
    def survival(self) -> list[float] | None:
        """a_k = Π_{i≤k} c_i for k = 1..drafted."""
        if self.confidence is None:
            return None
        return torch.tensor(self.confidence, dtype=torch.float64).cumprod(0).tolist()

    @property
    def raw_survival(self) -> list[float] | None:
        """a_k before calibration: Π_{i≤k} σ(z_i)."""
        if self.raw_logits is None:
            return None
        return torch.tensor(self.raw_logits, dtype=torch.float64).sigmoid().cumprod(0).tolist()


@dataclass
class PromptRollout:
    """One prompt's rollout: its rounds, the generation stats (times) and the generated tokens."""

    dataset: str
    rounds: list[RoundRecord]
    stats: GenerationStats
    tokens: list[int] = field(default_factory=list)


class DrafterWrapper(Drafter):
    """A drafter that forwards everything to `inner`; subclasses change `propose`."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.target_layer_ids = inner.target_layer_ids
        self.vocab_size = inner.vocab_size
        self.max_block_size = inner.max_block_size

    def start(self, prompt_ids: torch.Tensor, prompt_hidden: torch.Tensor | None) -> Any:
        return self.inner.start(prompt_ids, prompt_hidden)

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        return self.inner.propose(state, context, num_tokens, sampling, generator)

    def commit(self, state: Any, committed_hidden: torch.Tensor | None) -> None:
        self.inner.commit(state, committed_hidden)

    def drafts_for_free(self, state: Any, context: torch.Tensor) -> bool:
        return self.inner.drafts_for_free(state, context)

    def pending_positions(self, state: Any) -> int:
        return self.inner.pending_positions(state)


def _dspark_model(drafter: Drafter):
    """The DSparkModel under a (possibly wrapped) drafter, or None for other drafter families."""
    while isinstance(drafter, DrafterWrapper):
        drafter = drafter.inner
    model = getattr(drafter, "model", None)
    return model if hasattr(model, "confidence_logits") and hasattr(model, "confidence") else None


class RecordingDrafter(DrafterWrapper):
    """Keeps each round's draft, keyed by round index (= rounds already recorded in `stats`): a round
    that asked for no drafts never calls `propose`, so counting calls would misalign."""

    def __init__(self, inner: Drafter, stats: GenerationStats) -> None:
        super().__init__(inner)
        self.stats = stats
        self.drafts: dict[int, tuple[Draft, torch.Tensor | None]] = {}
        self._raw_logits: torch.Tensor | None = None

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        self._raw_logits = None
        draft = self.inner.propose(state, context, num_tokens, sampling, generator)
        self.drafts[len(self.stats.accepted_per_round)] = (draft, self._raw_logits)
        return draft

    @contextlib.contextmanager
    def capturing_raw_logits(self) -> Iterator[None]:
        """While active, the DSpark model's calibration step also hands us its input (raw logits)."""
        model = _dspark_model(self.inner)
        if model is None:
            yield
            return
        calibrate = model.confidence

        def capture(confidence_logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self._raw_logits = confidence_logits.detach().float().cpu().reshape(-1)  # one request: (1, n)
            return calibrate(confidence_logits, *args, **kwargs)

        model.confidence = capture  # an instance attribute shadowing the method, removed below
        try:
            yield
        finally:
            del model.confidence

    def records(self, dataset: str = "") -> list[RoundRecord]:
        stats = self.stats
        # a round that verified nothing predicts nothing ([]), but only a drafter with confidences predicts
        scored = any(draft.confidence is not None for draft, _ in self.drafts.values())
        rounds = []
        for index, (drafted, accepted) in enumerate(zip(stats.drafted_per_round, stats.accepted_per_round,
                                                        strict=True)):
            draft, raw = self.drafts.get(index, (None, None))
            confidence = [] if drafted == 0 and scored else None
            raw_logits = [] if drafted == 0 and scored else None
            if draft is not None and draft.confidence is not None:
                confidence = draft.confidence[:drafted].float().cpu().tolist()
            if raw is not None:
                raw_logits = raw[:drafted].tolist()
            rounds.append(RoundRecord(drafted, accepted, confidence, raw_logits, dataset))
        return rounds


def rollout_prompt(
    loaded: LoadedTarget,
    drafter: Drafter,
    ids: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    block_size: int,
    seed: int | None = 0,
    dataset: str = "",
) -> PromptRollout:
    """Generate for one tokenised prompt and record every round."""
    stats = GenerationStats()
    recorder = RecordingDrafter(drafter, stats)
    engine = build_engine(loaded, recorder, block_size=block_size)
    request = Request(ids, max_new_tokens, sampling, make_generator(seed), eos_token_ids(loaded), stats=stats)
    tokens: list[int] = []
    with recorder.capturing_raw_logits():
        for chunk in engine.stream(request):
            tokens.extend(chunk)
    return PromptRollout(dataset, recorder.records(dataset), stats, tokens)


def run_rollouts(
    loaded: LoadedTarget,
    drafter: Drafter,
    prompts: Sequence[tuple[str, str]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    block_size: int,
    seed: int = 0,
) -> list[PromptRollout]:
    """Roll out (dataset name, prompt text) pairs through the target's chat template; prompt i uses
    seed + i, so runs are reproducible and prompts do not share random streams."""
    return [
        rollout_prompt(loaded, drafter, prompt_ids(loaded, prompt), max_new_tokens=max_new_tokens,
                       sampling=sampling, block_size=block_size, seed=seed + index, dataset=dataset)
        for index, (dataset, prompt) in enumerate(prompts)
    ]


def all_rounds(rollouts: Sequence[PromptRollout]) -> list[RoundRecord]:
    """Every round of every rollout, in order."""
    return [record for rollout in rollouts for record in rollout.rounds]
