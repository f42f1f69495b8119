"""The one way to build an engine for a loaded target and a drafter: `generate`, `serve`, `eval` and the
benchmarks all call `build_engine`, so γ (`resolve_block_size`), the scheduler a drafter can use, the
SPS profile it needs and the backend cannot drift apart between entry points.

`generation.speculative_decode` stays the lower-level path: a backend and a γ taken as given.
"""

from dspark.drafters.base import Drafter
from dspark.engine import Engine, make_backend
from dspark.gate import DraftGate
from dspark.loading import LoadedTarget
from dspark.profiling import draft_cost, round_cost
from dspark.scheduler import RoundCost, StepCurve, get_scheduler, plans_drafting, resolve_block_size


def has_confidences(drafter: Drafter) -> bool:
    """Whether the drafter estimates its drafts' survival (a DSpark confidence head); for the others
    every a_k is 1, so a load-aware scheduler has nothing to rank."""
    return bool(getattr(getattr(drafter, "config", None), "enable_confidence_head", False))


def scheduler_for(name: str, drafter: Drafter, block_size: int) -> str:
    """The scheduler to run for `name`: a drafter without confidences verifies every draft unless a
    fixed count (or none) is asked for, and with γ = 0 there is nothing to schedule."""
    get_scheduler(name)
    if block_size == 0 or (not has_confidences(drafter) and not name.startswith("fixed") and name != "none"):
        return "fixed"
    return name


def step_rates(loaded: LoadedTarget, scheduler: str, block_size: int, max_concurrency: int = 1,
               compiled: bool = False, layer_ids: tuple[int, ...] = ()) -> RoundCost | None:
    """SPS_R(B) for the "dspark*" schedulers (None for the others), for rounds of up to `max_concurrency`
    requests of γ + 1 tokens; profiled once per target and forward (eager or `compiled`) and cached
    (`dspark.profiling`): the compiled forward's steps are cheaper, so a round's drafts are worth another count."""
    if not scheduler.startswith("dspark"):
        return None
    return round_cost(loaded, max_concurrency, block_size, compiled=compiled, layer_ids=layer_ids)


def build_engine(
    loaded: LoadedTarget,
    drafter: Drafter,
    *,
    scheduler: str = "fixed",
    block_size: int | None = None,
    max_concurrency: int = 1,
    prefill_chunk: int = 512,
    max_context: int | None = None,
    sps: StepCurve | RoundCost | None = None,
    as_named: bool = False,
    draft_gate: "bool | DraftGate | None" = None,
    compile: bool = False,
) -> Engine:
    """An engine with `max_concurrency` slots on `loaded`'s model, drafting with `drafter`.

    `block_size`: γ asked for (None: the drafter's own); `sps`: step rates already measured (a `RoundCost`
    or one curve; else profiled when the scheduler needs one). `as_named` runs `scheduler` even on a drafter
    without confidences, where Algorithm 1 then cuts by SPS(B) alone: the load benchmark compares
    policies by name, everything else lets such a drafter verify every draft. `draft_gate`: skip drafting in
    rounds where plain decoding measured faster (`dspark.gate`); None: on for the dspark schedulers (they decide
    per round anyway), off for fixed, threshold and none, whose rounds draw what their name says. Pass one
    `DraftGate` to several engines to share what it measured. `compile`: the target's decode and verify
    forwards compiled, one request's and rounds of several (`dspark.compiled`: ~1 min a graph once per process
    and model, then faster steps on a CPU), and the drafter's round where it has a compiled one (DSpark:
    `dspark.drafters.compiled_block`).
    """
    if compile:  # the drafter's round too, where it has a compiled one (`Drafter.compiled`)
        drafter = drafter.compiled()
    block_size = resolve_block_size(block_size, drafter_limit=drafter.max_block_size, scheduler=scheduler)
    chosen = scheduler if as_named else scheduler_for(scheduler, drafter, block_size)
    if sps is None:
        # compiled: profiled with the drafter's feature layers, so profile and engine share one compilation
        layer_ids = drafter.target_layer_ids if compile else ()
        sps = step_rates(loaded, chosen, block_size, max_concurrency, compile, layer_ids)
    if plans_drafting(chosen) and block_size > 0 and isinstance(sps, RoundCost) and not sps.draft_seconds:
        # it decides who drafts before drafting, so it weighs the drafter's (profiled) cost too
        sps = RoundCost(sps.verify, draft_cost(loaded, drafter, max_concurrency, block_size))
    backend = make_backend(loaded.model, drafter.target_layer_ids, max_slots=max_concurrency, compile=compile)
    return Engine(backend, drafter, block_size=block_size, scheduler=chosen, sps=sps, max_concurrency=max_concurrency,
                  prefill_chunk=prefill_chunk, max_context=max_context,
                  gate=resolve_gate(draft_gate, chosen, block_size))


def resolve_gate(draft_gate: "bool | DraftGate | None", scheduler: str, block_size: int) -> "DraftGate | None":
    """The engine's draft gate: as given, a new one (True), none (False), or by scheduler (None)."""
    if isinstance(draft_gate, DraftGate):
        return draft_gate
    if draft_gate is None:
        draft_gate = isinstance(scheduler, str) and scheduler.startswith("dspark")
    return DraftGate() if draft_gate and block_size > 0 else None
