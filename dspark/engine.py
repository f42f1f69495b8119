"""Continuous batching: requests join and leave between rounds.

A round, for every running request at once: draft → schedule (how many drafts each request sends)
→ one ragged target forward (verify segments = anchor + ℓ_r drafts; prompt chunks of new requests
ride along) → verify and commit per request (own sampling parameters and generator) → roll each
slot back past its rejected drafts. With one request this is plain speculative decoding, and with
no drafts it is plain decoding: every path of the library goes through here.
"""

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dspark.drafters.base import Draft, Drafter
from dspark.errors import DsparkError
from dspark.gate import DraftGate
from dspark.ragged import RaggedBackend, Segment, SlotCache, supports_ragged
from dspark.sampling import SamplingParams, next_token
from dspark.scheduler import (
    DEFAULT_BLOCK_SIZE,
    RoundCost,
    Scheduler,
    SchedulerState,
    StepCurve,
    get_scheduler,
    resolve_block_size,
)
from dspark.stats import EngineStats, GenerationStats
from dspark.target import SerialBackend, TargetOutput
from dspark.verify import emitted_tokens, verify

log = logging.getLogger("dspark.engine")


class TargetBackend(Protocol):
    """What the engine needs of a target: slots with their own KV length, one forward over segments."""

    layer_ids: tuple[int, ...]
    max_slots: int

    def allocate(self) -> int: ...
    def release(self, slot: int) -> None: ...
    def length(self, slot: int) -> int: ...
    def rollback(self, slot: int, length: int) -> None: ...
    def forward(self, segments: list[Segment]) -> list[TargetOutput]: ...


def make_backend(model: Any, layer_ids: tuple[int, ...] = (), max_slots: int = 1,
                 attention: str = "loop", compile: bool = False) -> TargetBackend:
    """The ragged batched forward for Llama-family models, else HF's forward one request at a time. `compile`:
    decode and verify steps run `torch.compile`d (`dspark.compiled`; the ragged forward only)."""
    if supports_ragged(model):
        return RaggedBackend(model, layer_ids, max_slots=max_slots, attention=attention, compile=compile)
    return SerialBackend.for_model(model, layer_ids, max_slots=max_slots)


class GenerationFailed(Exception):
    """Why the engine ended one request early (finish reason "error"). The message names the phase
    only: the cause (a torch message, say) is for the server log, not for clients."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"generation failed while {phase}")
        self.phase, self.cause = phase, cause

    @property
    def out_of_memory(self) -> bool:
        return is_out_of_memory(self.cause)


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError | MemoryError) or "out of memory" in str(error).lower()


@dataclass(eq=False)
class Request:
    """One generation. The engine fills `output_ids`, `stats`, `finished`, `finish_reason` and,
    when it had to end the request early, `error`. `block_size` caps γ for this request alone."""

    prompt_ids: torch.Tensor
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    eos_token_ids: frozenset[int] = frozenset()
    block_size: int | None = None
    #: a seeded sampled request: the draft gate (timing-driven) leaves its drafting to the scheduler, so the same
    #: seed draws the same tokens whatever the machine's speed (greedy output never depends on drafting)
    reproducible: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    output_ids: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    finished: bool = False
    finish_reason: str | None = None
    error: GenerationFailed | None = None
    # engine state
    slot: int | None = field(default=None, repr=False)
    context: torch.Tensor | None = field(default=None, repr=False)  # committed tokens; last = anchor
    drafter_state: Any = field(default=None, repr=False)
    num_prefilled: int = field(default=0, repr=False)  # prompt tokens already in the KV cache
    prompt_features: list = field(default_factory=list, repr=False)
    started: float = field(default=0.0, repr=False)

    @property
    def prefilled(self) -> bool:
        """The whole prompt is in the cache and the anchor sampled: the request drafts and verifies."""
        return self.context is not None


class Engine:
    """Runs requests to completion in rounds; `step()` runs one round and returns the new tokens.

    `scheduler`: a name for `get_scheduler` ("none" = plain decoding, "fixed", "fixed-<n>",
    "threshold[-t]", "dspark", "dspark-async") or a `Scheduler` function. The schedulers see the
    drafts' survival a_k (all ones for drafters without confidences) and `sps`, the target's step
    rate SPS(B) (one curve, or a `RoundCost` with a curve per number of requests and the drafting cost),
    never the target's answer, so verification stays lossless. `block_size` is γ as given;
    `dspark.factory.build_engine` resolves it against the drafter first. `gate`: a `DraftGate` that skips
    drafting in rounds where the engine measured plain decoding faster (None: every round drafts).
    """

    def __init__(
        self,
        backend: TargetBackend,
        drafter: Drafter,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        scheduler: str | Scheduler = "fixed",
        sps: StepCurve | RoundCost | None = None,
        max_concurrency: int | None = None,
        prefill_chunk: int = 512,
        max_context: int | None = None,
        gate: DraftGate | None = None,
    ) -> None:
        self.schedule: Scheduler | None = None if isinstance(scheduler, str) else scheduler
        if isinstance(scheduler, str):
            self.schedule = None if scheduler in ("fixed", "none") else get_scheduler(scheduler)
            if scheduler.startswith("dspark") and sps is None:
                raise DsparkError(f"scheduler {scheduler!r} needs the target's SPS table (dspark profile)")
        if max_concurrency is None:
            max_concurrency = backend.max_slots
        if not 1 <= max_concurrency <= backend.max_slots:
            raise DsparkError(f"max_concurrency must be in [1, {backend.max_slots}] (the target's slots), "
                              f"got {max_concurrency}")
        if prefill_chunk < 1:
            raise DsparkError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.backend = backend
        self.drafter = drafter
        self.block_size = resolve_block_size(block_size, scheduler=scheduler)
        self.cost = None if sps is None else RoundCost.of(sps)
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.scheduler_state = SchedulerState()
        self.stats = EngineStats()
        self.gate = gate
        self._gate_open = True  # this round's decision
        self._catching_up = False  # this round's drafts first absorb many committed positions: not measured
        self._free: set[int] = set()  # ids of this round's requests drafting by lookup hits (made where the plan skips)

    # -- requests ----------------------------------------------------------------------------------

    def add(self, request: Request) -> Request:
        if request.prompt_ids.ndim != 1 or not request.prompt_ids.shape[0]:
            raise DsparkError("a request needs a non-empty 1-D tensor of prompt ids")
        if request.max_new_tokens <= 0:
            raise DsparkError(f"max_new_tokens must be > 0, got {request.max_new_tokens}")
        total = int(request.prompt_ids.shape[0]) + request.max_new_tokens
        if self.max_context is not None and total > self.max_context:
            raise DsparkError(f"prompt ({request.prompt_ids.shape[0]} tokens) + max_new_tokens "
                              f"({request.max_new_tokens}) exceeds the context window of {self.max_context}")
        request.stats.num_prompt_tokens = int(request.prompt_ids.shape[0])
        self.stats.num_prompt_tokens += request.stats.num_prompt_tokens
        self.waiting.append(request)
        return request

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Stop a request now (client gone, stop string hit): its slot and draft cache are freed."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one round ---------------------------------------------------------------------------------

    def step(self) -> list[tuple[Request, list[int]]]:
        """One round for every running request; returns (request, newly committed tokens) pairs.

        Faults are isolated: a request whose drafting or sampling fails is finished alone with
        `error` set, and a target forward that fails (out of memory) sheds the largest request and is
        redone for the others, so their outputs are what they would have been without it."""
        self._admit()
        if not self.running:
            return []
        start = time.perf_counter()
        prefilled = [r for r in self.running if r.prefilled]
        proposed = self._draft(prefilled)
        kept = [(r, d) for r, d in zip(prefilled, proposed, strict=True) if not r.finished]
        drafted = time.perf_counter()
        drafts = self._scheduled([r for r, _ in kept], [d for _, d in kept])
        scheduled = time.perf_counter()
        work = [_Work(r, Segment(r.slot, torch.cat([r.context[-1:], d.tokens.cpu()])), draft=d)
                for (r, _), d in zip(kept, drafts, strict=True)]
        work += [_Work(r, Segment(r.slot, chunk, "last" if last else "none"), last=last)
                 for r, chunk, last in self._prefill_chunks([r for r in self.running if not r.prefilled])]
        decoding_only = all(item.draft is not None for item in work)
        events, rounds = self._commit_all(self._forward(work))
        end = time.perf_counter()
        if self.gate is not None and prefilled:
            unmeasured = self._unmeasured(len(prefilled), decoding_only)
            if unmeasured is None:
                self.gate.record(len(prefilled), self._gate_open, expected_tokens(rounds, events, self._free),
                                 end - start)
            else:
                self.gate.unmeasured(len(prefilled), self._gate_open, unmeasured, end - start)

        self._account([r for r, _ in rounds], [d for _, d in rounds], start, drafted, scheduled, end)
        self.stats.num_drafted += sum(len(d) for d in proposed)
        self.stats.num_generated += sum(len(tokens) for _, tokens in events)
        for request in [r for r in self.running if r.finish_reason is not None]:
            self._finish(request, request.finish_reason)
        return events

    def _unmeasured(self, num_requests: int, decoding_only: bool) -> str | None:
        """Why the gate must not judge by this round (None: it may): a prompt chunk dwarfs the decode, a drafter
        catching up pays once what a drafting round does not, and a round of lookup drafts only runs no drafting
        model. (A closed round verifies no lookup draft: one row's lookup made a round of 8 requests ~20% slower
        for ~1 more token, session 28.)"""
        if not decoding_only:
            return "prefill"
        if self._catching_up:
            return "catch-up"
        if len(self._free) >= num_requests:
            return "free"
        return None

    def fail(self, request: Request, error: GenerationFailed) -> None:
        """End one request with `error` (logged with its cause); the others carry on."""
        if request.finished:
            return
        log.warning("request %s failed: %s", request.request_id, error, exc_info=error.cause)
        request.error = error
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "error")

    def largest_request(self) -> Request | None:
        """The request holding the most KV cache (the first to shed when memory runs out)."""
        if self.running:
            return max(self.running, key=footprint)
        return self.waiting[0] if self.waiting else None

    def _admit(self) -> None:
        if self.waiting and not self.running:
            # an idle engine forgets the rounds of earlier requests: what dspark-async schedules (and so how
            # a seeded sampled request draws) then depends only on the requests decoded together
            self.scheduler_state = SchedulerState()
        while self.waiting and len(self.running) < self.max_concurrency:
            request = self.waiting.popleft()
            request.slot = self.backend.allocate()
            request.started = time.perf_counter()
            self.running.append(request)

    def _draft(self, requests: list[Request]) -> list[Draft]:
        """Drafts of every prefilled request; one whose drafting fails is failed (its draft: empty)."""
        num_tokens = [resolve_block_size(self.block_size, request_limit=r.block_size,
                                         tokens_left=r.max_new_tokens - len(r.output_ids)) for r in requests]
        prefilling = len(requests) < len(self.running)  # a prompt chunk shares the round: the gate cannot measure it
        self._gate_open = self.gate is None or not requests or self.gate.should_draft(len(requests), not prefilling)
        begin_round = getattr(self.schedule, "begin_round", None)  # dspark-async: K and who drafts known first
        # lookup hits are looked for only where a plan may skip a request and the gate is open: a closed round
        # verifies none (session 28: one row's lookup made a round of 8 requests ~20% slower for ~1 more token)
        planned = (begin_round is not None or self.gate is not None) and self._gate_open
        free = [planned and self._drafts_for_free(r) for r in requests]
        self._free = {id(r) for r, f in zip(requests, free, strict=True) if f}
        if requests and begin_round is not None:
            drafting = begin_round(self.cost, self.scheduler_state, [r.request_id for r in requests])
            num_tokens = [n if r.request_id in drafting or f else 0
                          for r, n, f in zip(requests, num_tokens, free, strict=True)]
        if not self._gate_open:  # plain decoding measured faster: only reproducible drafts
            num_tokens = [n if r.reproducible else 0 for r, n in zip(requests, num_tokens, strict=True)]
        active = [i for i, n in enumerate(num_tokens) if n > 0]
        self._catching_up = self.gate is not None and any(  # a lookup hit runs no model: its backlog waits
            self._pending(requests[i]) > self.block_size + 1 for i in active if not free[i])
        drafts = [Draft.empty() for _ in requests]
        proposed = self._propose([requests[i] for i in active], [num_tokens[i] for i in active])
        for i, draft in zip(active, proposed, strict=True):
            if draft is not None:
                drafts[i] = draft.truncate(num_tokens[i])
        return drafts

    def _drafts_for_free(self, request: Request) -> bool:
        """A draft that runs no model (a lookup hit) is made even where the plan skipped drafting; if asking
        fails, the proposal itself will report it."""
        try:
            return self.drafter.drafts_for_free(request.drafter_state, request.context)
        except Exception:
            return False

    def _pending(self, request: Request) -> int:
        """Positions the drafter must absorb before this request's draft (its prompt, or the rounds it skipped)."""
        try:
            return self.drafter.pending_positions(request.drafter_state)
        except Exception:
            return 0

    def _propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft | None]:
        """One batched proposal; if it fails, each request again alone from the same generator
        states, to find the one at fault (batched drafters only read their states in a proposal)."""
        if not requests:
            return []
        # a loop anyway (or a duck-typed wrapper without its own batch method): isolate each call
        if getattr(type(self.drafter), "propose_batch", Drafter.propose_batch) is Drafter.propose_batch:
            return [self._propose_alone(r, n) for r, n in zip(requests, num_tokens, strict=True)]
        saved = [_generator_state(r.generator) for r in requests]
        try:
            return self.drafter.propose_batch([r.drafter_state for r in requests], [r.context for r in requests],
                                              num_tokens, [r.sampling for r in requests],
                                              [r.generator for r in requests])
        except Exception:
            for request, state in zip(requests, saved, strict=True):
                _restore_generator(request.generator, state)
            return [self._propose_alone(r, n) for r, n in zip(requests, num_tokens, strict=True)]

    def _propose_alone(self, request: Request, num_tokens: int) -> Draft | None:
        try:
            return self.drafter.propose_batch([request.drafter_state], [request.context], [num_tokens],
                                              [request.sampling], [request.generator])[0]
        except Exception as error:
            self.fail(request, GenerationFailed("drafting", error))
            return None

    def _scheduled(self, requests: list[Request], drafts: list[Draft]) -> list[Draft]:
        if self.schedule is None or not any(len(d) for d in drafts):
            return drafts
        survival = [d.survival.tolist() if d.survival is not None else [1.0] * len(d) for d in drafts]
        self.scheduler_state.keys = [r.request_id for r in requests]
        curve = self.cost.curve(len(drafts)) if self.cost is not None else None
        lengths = self.schedule(survival, curve, self.scheduler_state)
        return [d.truncate(n) for d, n in zip(drafts, lengths, strict=True)]

    def _prefill_chunks(self, requests: list[Request]) -> list[tuple[Request, torch.Tensor, bool]]:
        """Prompt chunks for this round, at most `prefill_chunk` tokens in all (first come first)."""
        chunks, room = [], self.prefill_chunk
        for request in requests:
            if room <= 0:
                break
            prompt = request.prompt_ids
            end = min(prompt.shape[0], request.num_prefilled + room)
            chunks.append((request, prompt[request.num_prefilled : end], end == prompt.shape[0]))
            room -= end - request.num_prefilled
        return chunks

    def _forward(self, work: list["_Work"]) -> list[tuple["_Work", TargetOutput]]:
        """The round's target forward. When it fails (out of memory, typically) every slot is rolled
        back, the request holding the most KV cache is failed, and the forward is redone without it."""
        while work:
            lengths = [self.backend.length(item.segment.slot) for item in work]
            try:
                return list(zip(work, self.backend.forward([item.segment for item in work]), strict=True))
            except Exception as error:
                for item, length in zip(work, lengths, strict=True):
                    if self.backend.length(item.segment.slot) > length:
                        self.backend.rollback(item.segment.slot, length)
                largest = max(work, key=lambda item: footprint(item.request))
                self.fail(largest.request, GenerationFailed("running the target", error))
                work = [item for item in work if item is not largest]
        return []

    def _commit_all(self, done: list[tuple["_Work", TargetOutput]]) -> tuple[list, list]:
        """(request, new tokens) events and the (request, draft) rounds that committed."""
        events, rounds = [], []
        for item, output in done:
            tokens = self._commit(item, output)
            if tokens is None:
                continue
            if item.draft is not None:
                rounds.append((item.request, item.draft))
            if tokens or item.draft is not None:
                events.append((item.request, tokens))
        return events, rounds

    def _commit(self, item: "_Work", output: TargetOutput) -> list[int] | None:
        """The tokens `item` commits this round, or None if committing failed (the request is failed)."""
        try:
            if item.draft is not None:
                return self._commit_round(item.request, item.draft, output)
            return self._commit_prefill(item.request, item.segment.token_ids, item.last, output)
        except Exception as error:
            phase = "sampling and verifying" if item.draft is not None else "sampling the first token"
            self.fail(item.request, GenerationFailed(phase, error))
            return None

    def _commit_prefill(self, request: Request, chunk: torch.Tensor, last: bool, output: TargetOutput) -> list[int]:
        request.num_prefilled += int(chunk.shape[0])
        if output.hidden is not None:
            request.prompt_features.append(output.hidden)
        if not last:
            return []
        features = torch.cat(request.prompt_features) if request.prompt_features else None
        request.prompt_features = []
        request.drafter_state = self.drafter.start(request.prompt_ids, features)
        anchor = next_token(output.logits[-1], request.sampling, request.generator)
        request.context = torch.cat([request.prompt_ids.cpu(), torch.tensor([anchor])])
        request.stats.prefill_time = time.perf_counter() - request.started
        return self._emit(request, [anchor])

    def _commit_round(self, request: Request, draft: Draft, output: TargetOutput) -> list[int]:
        tokens = draft.tokens.cpu()
        verdict = verify(tokens, draft.q, output.logits, request.sampling, request.generator)
        cached = request.context.shape[0] - 1  # everything before the anchor
        self.backend.rollback(request.slot, cached + 1 + verdict.num_accepted)
        hidden = None if output.hidden is None else output.hidden[: 1 + verdict.num_accepted]
        self.drafter.commit(request.drafter_state, hidden)
        request.stats.record_round(len(draft), verdict.num_accepted)
        new_tokens = self._emit(request, emitted_tokens(tokens, verdict))
        request.context = torch.cat([request.context, torch.tensor(new_tokens)])
        return new_tokens

    def _emit(self, request: Request, tokens: list[int]) -> list[int]:
        """Cut at the first EOS (kept, as HF does) and at max_new_tokens; mark the request done."""
        for i, token in enumerate(tokens):
            if token in request.eos_token_ids:
                tokens = tokens[: i + 1]
                request.finish_reason = "stop"
                break
        tokens = tokens[: request.max_new_tokens - len(request.output_ids)]
        request.output_ids.extend(tokens)
        request.stats.num_generated = len(request.output_ids)
        if request.finish_reason is None and len(request.output_ids) >= request.max_new_tokens:
            request.finish_reason = "length"
        return tokens

    def _finish(self, request: Request, reason: str) -> None:
        request.finished = True
        request.finish_reason = reason
        request.stats.finish_reason = reason
        if request.started:
            request.stats.total_time = time.perf_counter() - request.started
        if request in self.running:
            self.running.remove(request)
            self.backend.release(request.slot)
            self.stats.num_requests_finished += 1
            cache = getattr(self.backend, "cache", None)
            if isinstance(cache, SlotCache):
                cache.reclaim()
        request.drafter_state = None
        request.prompt_features = []

    def _account(self, verified, drafts, start, drafted, scheduled, end) -> None:
        """Times and counts of a round; `verified`: the requests whose drafts (maybe none) were verified."""
        stats = self.stats
        stats.num_rounds += 1
        stats.round_time += end - start
        stats.scheduler_time += scheduled - drafted
        for request, draft in zip(verified, drafts, strict=True):
            request.stats.draft_time += scheduled - start
            request.stats.verify_time += end - scheduled
            stats.num_verified += len(draft)
            stats.num_accepted += request.stats.accepted_per_round[-1]
        if verified:
            stats.verify_rounds += 1
            stats.request_rounds += len(verified)
            stats.verified_per_request_sum += sum(len(d) for d in drafts) / len(verified)
        for request in self.running:
            request.stats.total_time = end - request.started

    # -- driving -----------------------------------------------------------------------------------

    def run(self, requests: list[Request], on_round: Callable[[list], None] | None = None) -> list[Request]:
        """Add every request and step until all are finished."""
        for request in requests:
            self.add(request)
        while self.has_work:
            events = self.step()
            if on_round is not None:
                on_round(events)
        return requests

    def stream(self, request: Request) -> Iterator[list[int]]:
        """Add one request and yield its new tokens round by round (other requests keep running)."""
        self.add(request)
        try:
            while not request.finished:
                for owner, tokens in self.step():
                    if owner is request and tokens:
                        yield tokens
        finally:
            self.abort(request)


@dataclass
class _Work:
    """One request's part of a round's forward: a verify segment (with its draft) or a prompt chunk."""

    request: Request
    segment: Segment
    draft: Draft | None = None
    last: bool = False  # a prompt chunk that ends the prompt


def expected_tokens(rounds: list[tuple[Request, Draft]], events: list[tuple[Request, list[int]]],
                    free: Collection[int] = ()) -> float:
    """Tokens a round commits in expectation: per request 1 + Σ a_k over its verified drafts (the confidences'
    survival), or what it committed where its draft has no confidences or it verified none. At one request a
    drafting round commits 1 to γ + 1 tokens, so the gate, comparing rounds that drafted with rounds that did
    not, would need tens of them per estimate; the expectation varies far less (session 15: 3 unlucky drafting
    rounds at one request read 26 tokens/s against 41 over 50, and kept drafting off for 30 rounds).

    A request in `free` (ids: its draft was a lookup hit, made even where the plan skipped drafting) counts 1: its
    draft says nothing about drafting against plain decoding. Counted, a lookup hit in one of the rare plain
    rounds read ~4x a plain round's speed and closed drafting for up to 64 rounds (session 16, bench load at one
    request: 116 plain rounds against 664, the gate 13% below no gate)."""
    committed: dict[int, int] = {}
    for request, tokens in events:
        committed[id(request)] = committed.get(id(request), 0) + len(tokens)
    total = 0.0
    for request, draft in rounds:
        if id(request) in free:
            total += 1.0
            continue
        survival = draft.survival if len(draft) else None
        total += 1.0 + float(survival.sum()) if survival is not None else committed.get(id(request), 0)
    return total


def footprint(request: Request) -> int:
    """Tokens of KV cache a request holds (or will hold once prefilled)."""
    return int(request.prompt_ids.shape[0]) + len(request.output_ids)


def _generator_state(generator: torch.Generator | None) -> torch.Tensor | None:
    return None if generator is None else generator.get_state()


def _restore_generator(generator: torch.Generator | None, state: torch.Tensor | None) -> None:
    if generator is not None and state is not None:
        generator.set_state(state)
