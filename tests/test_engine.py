"""The batched runtime: ragged forward against HF, continuous batching against single requests, and
statistical losslessness with several concurrent requests and the confidence scheduler on."""

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model
from stats_helpers import MarkovDrafter, MarkovTarget, chi_square_pvalue, exact_marginals, random_tables
from transformers import MistralConfig, MistralForCausalLM

from dspark import engine as engine_module
from dspark.drafters.base import Draft, NoDrafter
from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark_config import DSparkConfig
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.drafters.lookup_first import LookupFirstDrafter
from dspark.drafters.ngram import NgramDrafter, ngram_lookup
from dspark.engine import Engine, Request, expected_tokens, make_backend
from dspark.errors import DsparkError
from dspark.gate import DraftGate
from dspark.ragged import (
    RaggedBackend,
    Segment,
    default_attention_dtype,
    half_signed,
    rms_norm,
    rotate,
    round_layouts,
)
from dspark.sampling import SamplingParams, make_generator
from dspark.scheduler import PROBE_EVERY, SPSTable
from dspark.target import SerialBackend, Target

ALPHA = 1e-3


def tiny_mistral():
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=None, eos_token_id=2)
    return MistralForCausalLM(config).eval()


def model_of(arch: str):
    return tiny_mistral() if arch == "mistral" else tiny_model(arch, num_layers=3)


def prompts(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=generator)
            for n in torch.randint(3, 20, (count,), generator=generator)]


# ------------------------------------------------------------------------------- ragged forward


@pytest.mark.parametrize("attention", ["loop", "padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_ragged_forward_matches_hf(arch, attention):
    model = model_of(arch)
    layer_ids = (-1, 0, model.config.num_hidden_layers - 1)
    ragged = RaggedBackend(model, layer_ids, max_slots=4, attention=attention)
    sequences = prompts(3, seed=1)
    slots = [ragged.allocate() for _ in sequences]
    first = ragged.forward([Segment(s, q[:-3], "last") for s, q in zip(slots, sequences, strict=True)])
    second = ragged.forward([Segment(s, q[-3:], "all") for s, q in zip(slots, sequences, strict=True)])
    for sequence, head, tail in zip(sequences, first, second, strict=True):
        reference = Target(model, layer_ids).extend(sequence)
        torch.testing.assert_close(head.logits[0], reference.logits[-4], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tail.logits, reference.logits[-3:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.cat([head.hidden, tail.hidden]), reference.hidden, atol=1e-4, rtol=1e-4)

    ragged.rollback(slots[0], 2)  # drop everything after position 2 and recompute it
    again = ragged.forward([Segment(slots[0], sequences[0][2:], "all")])[0]
    torch.testing.assert_close(again.logits, Target(model).extend(sequences[0]).logits[2:], atol=1e-4, rtol=1e-4)
    assert ragged.length(slots[0]) == sequences[0].shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_rms_norm_is_bit_identical_to_the_module(arch, dtype):
    model = model_of(arch).to(dtype)
    layer = model.model.layers[0]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm]
    norms += [n for n in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)) if n]
    assert len(norms) == (5 if arch == "qwen3" else 3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=generator))
            x = (3 * torch.randn(7, 5, norm.weight.shape[0], generator=generator)).to(dtype)
            assert torch.equal(rms_norm(x, norm), norm(x))
    other = torch.nn.LayerNorm(8)  # not an RMSNorm: runs as its own module
    x = torch.randn(3, 8)
    assert torch.equal(rms_norm(x, other), other(x))


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary formula, as written in modeling_llama: the reference for `rotate`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_with_signed_sin_is_bit_identical_to_rotate_half(dtype):
    generator = torch.Generator().manual_seed(0)
    x, cos, sin = (torch.randn(shape, generator=generator).to(dtype) for shape in [(6, 12, 64), (6, 1, 64), (6, 1, 64)])
    assert torch.equal(rotate(x, cos, half_signed(sin)), rotate_half(x, cos, sin))
    assert not torch.equal(rotate(x, cos, sin), rotate_half(x, cos, sin))  # the sign is what makes it so


@pytest.mark.parametrize("busy", [[0, 1, 2, 3], [3, 0, 2]])
def test_padded_attention_reads_contiguous_and_scattered_slots(busy):
    """All slots busy (the caches are read as a view, segments in any order) or a gap between them (gathered):
    one decode token per request equals the loop's result."""
    model = model_of("llama")
    sequences = prompts(len(busy), seed=2)
    outputs = {}
    for attention in ("loop", "padded"):
        ragged = RaggedBackend(model, max_slots=4, attention=attention)
        slots = [ragged.allocate() for _ in range(4)]
        assert sorted(slots) == [0, 1, 2, 3]
        pairs = list(zip(busy, sequences, strict=True))
        ragged.forward([Segment(slot, q[:-1], "none") for slot, q in pairs])
        outputs[attention] = ragged.forward([Segment(slot, q[-1:], "all") for slot, q in pairs])
    for loop, padded in zip(outputs["loop"], outputs["padded"], strict=True):
        torch.testing.assert_close(padded.logits, loop.logits, atol=1e-4, rtol=1e-4)


def test_a_prompt_chunk_beside_short_steps_is_attended_apart():
    """A chunk four times longer than every other segment gets its own SDPA (padded beside decoding requests it made
    each of them as many query rows); the rest are padded to at least 2 x 2 x 2 so one compiled graph serves every
    such round; and the padded forward with the chunk apart computes what the loop does, cache included."""
    short, chunk = round_layouts([0, 1, 2], [50, 60, 0], [1, 1, 70], slot_count=4)
    assert short.rows.tolist() == [0, 1] and chunk.rows.tolist() == list(range(2, 72))
    assert short.mask.shape == (2, 1, 2, 61) and chunk.mask.shape == (1, 1, 70, 70) and chunk.first_slot == 2
    assert len(round_layouts([0, 1], [50, 0], [1, 70], 4)) == 1  # one token beside the chunk: one block
    assert len(round_layouts([0, 1, 2], [50, 50, 0], [8, 1, 30], 4)) == 1  # not four times longer
    assert round_layouts([0, 1], [5, 0], [2, 8], 4)[0].mask.shape == (2, 1, 2, 7)  # one slot padded to two
    edge = round_layouts([3, 1], [50, 0], [2, 9], 4)[0]  # the last slot: the padded range turns downward
    assert edge.first_slot == 2 and edge.mask.shape[0] == 2 and edge.batch_index.tolist() == [1, 1]
    model = model_of("llama")
    sequences = prompts(3, seed=3)
    chunk_tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(4))
    backends = {attention: RaggedBackend(model, (0, 2), max_slots=4, attention=attention)
                for attention in ("loop", "padded")}
    outputs = {}
    for attention, ragged in backends.items():
        assert [ragged.allocate() for _ in range(4)] == [0, 1, 2, 3]
        ragged.forward([Segment(slot, q, "none") for slot, q in zip((0, 1, 3), sequences, strict=True)])
        outputs[attention] = ragged.forward([Segment(3, sequences[2][:2], "all"), Segment(2, chunk_tokens, "last"),
                                             Segment(0, sequences[0][:1], "all"), Segment(1, sequences[1][:3], "all")])
    assert len(round_layouts([3, 2, 0, 1], [len(q) for q in (sequences[2], [], *sequences[:2])], [2, 40, 1, 3], 4)) == 2
    for loop, padded in zip(outputs["loop"], outputs["padded"], strict=True):
        torch.testing.assert_close(padded.logits, loop.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(padded.hidden, loop.hidden, atol=1e-4, rtol=1e-4)
    loop, padded = backends["loop"].cache, backends["padded"].cache
    assert loop.lengths == padded.lengths
    for slot, length in enumerate(loop.lengths):
        torch.testing.assert_close(padded.keys[1][slot, :, :length], loop.keys[1][slot, :, :length])


def test_ragged_refuses_unsupported_models_and_the_engine_falls_back():
    gpt2 = tiny_model("gpt2")
    with pytest.raises(DsparkError, match="ragged batching supports"):
        RaggedBackend(gpt2)
    assert isinstance(make_backend(gpt2, max_slots=2), SerialBackend)
    assert isinstance(make_backend(tiny_model("llama"), max_slots=2), RaggedBackend)


def test_cache_grows_past_its_first_capacity():
    model = tiny_model("llama")
    ragged = RaggedBackend(model, max_slots=2)
    long = torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    slot = ragged.allocate()
    ragged.forward([Segment(slot, long[:200], "none")])
    out = ragged.forward([Segment(slot, long[200:], "all")])[0]
    torch.testing.assert_close(out.logits, Target(model).extend(long).logits[200:], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- continuous batching


def random_dspark(target_model, block_size: int = 4) -> DSparkDrafter:
    torch.manual_seed(3)
    config = DSparkConfig.for_target(target_model.config, num_hidden_layers=1, markov_rank=8, block_size=block_size,
                                     mask_token_id=VOCAB - 1)
    return DSparkDrafter(DSparkModel(config), target_model.get_input_embeddings(), target_model.get_output_embeddings())


@pytest.mark.parametrize("arch, drafter_kind", [("llama", "dspark"), ("qwen3", "ngram"), ("qwen2", "none"),
                                                ("gpt2", "ngram")])
def test_batched_greedy_equals_single_requests(arch, drafter_kind):
    """5 requests through 3 slots (the last ones join as the first leave), prompts prefilled in
    chunks of 5 tokens next to decoding requests: every output equals HF greedy decoding."""
    model = tiny_model(arch, num_layers=3)
    drafter = {"dspark": lambda: random_dspark(model), "ngram": lambda: NgramDrafter(max_ngram=2),
               "none": NoDrafter}[drafter_kind]()
    backend = make_backend(model, drafter.target_layer_ids, max_slots=3)
    engine = Engine(backend, drafter, block_size=4, prefill_chunk=5)
    requests = [Request(p, max_new_tokens=12 + 3 * i) for i, p in enumerate(prompts(5))]
    largest_batch = 0

    def watch(events):
        nonlocal largest_batch
        largest_batch = max(largest_batch, len(engine.running))

    engine.run(requests, on_round=watch)
    assert largest_batch == 3
    for request in requests:
        assert request.finished and request.finish_reason == "length"
        assert request.output_ids == hf_greedy(model, request.prompt_ids, request.max_new_tokens)
    assert engine.stats.num_generated == sum(len(r.output_ids) for r in requests)
    assert not engine.running and len(backend.free) == 3


@pytest.mark.parametrize("drafter_kind", ["dspark", "ngram"])
def test_bf16_speculative_greedy_equals_our_vanilla_greedy(drafter_kind):
    """In bf16 (float32 attention on a CPU) speculative decoding through 3 slots gives exactly what our own
    forward decodes one token at a time, one request at a time: verifying k tokens at once and batching requests
    change no row's numbers enough to flip an argmax."""
    model = tiny_model("llama", num_layers=3).to(torch.bfloat16)
    drafter = random_dspark(model) if drafter_kind == "dspark" else NgramDrafter(max_ngram=2)
    if drafter_kind == "dspark":
        drafter.model.to(torch.bfloat16)
    backend = make_backend(model, drafter.target_layer_ids, max_slots=3)
    assert backend.cache.keys[0].dtype == torch.float32
    requests = [Request(p, max_new_tokens=16) for p in prompts(5)]
    Engine(backend, drafter, block_size=4, prefill_chunk=5).run(requests)
    vanilla = Engine(make_backend(model, (), max_slots=1), NoDrafter())
    for request in requests:
        alone = Request(request.prompt_ids, max_new_tokens=16)
        vanilla.run([alone])
        assert request.output_ids == alone.output_ids


def test_attention_runs_in_float32_for_half_precision_targets_on_a_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_attention_dtype(torch.bfloat16, cpu) == default_attention_dtype(torch.float16, cpu) == torch.float32
    assert default_attention_dtype(torch.float32, cpu) == torch.float32
    assert default_attention_dtype(torch.bfloat16, cuda) == torch.bfloat16
    model = tiny_model("llama", num_layers=3).to(torch.bfloat16)
    tokens = prompts(1, seed=3)[0]
    reference = Target(model).extend(tokens).logits.float()  # HF's bf16 forward, bf16 attention
    for attention_dtype, cache_dtype in [(None, torch.float32), (torch.bfloat16, torch.bfloat16)]:
        backend = RaggedBackend(model, max_slots=1, attention_dtype=attention_dtype)
        assert backend.cache.keys[0].dtype == cache_dtype
        slot = backend.allocate()
        head = backend.forward([Segment(slot, tokens[:-4], "all")])[0].logits
        tail = backend.forward([Segment(slot, tokens[-4:], "all")])[0].logits
        assert head.dtype == torch.float32
        torch.testing.assert_close(torch.cat([head, tail]).float(), reference, atol=0.15, rtol=0.02)


def test_request_joining_mid_flight_and_abort():
    model = tiny_model("llama", num_layers=3)
    drafter = random_dspark(model)
    engine = Engine(make_backend(model, drafter.target_layer_ids, max_slots=4), drafter, block_size=4)
    first, second, doomed = (Request(p, max_new_tokens=20) for p in prompts(3, seed=4))
    engine.add(first)
    engine.add(doomed)
    for _ in range(3):
        engine.step()
    engine.abort(doomed)
    assert doomed.finished and doomed.finish_reason == "abort" and doomed not in engine.running
    engine.add(second)
    while engine.has_work:
        engine.step()
    for request in (first, second):
        assert request.output_ids == hf_greedy(model, request.prompt_ids, 20)
    assert len(engine.backend.free) == 4


def test_engine_rejects_bad_requests_and_settings():
    model = tiny_model("llama")
    backend = make_backend(model, max_slots=2)
    with pytest.raises(DsparkError, match="max_concurrency"):
        Engine(backend, NoDrafter(), max_concurrency=3)
    with pytest.raises(DsparkError, match="SPS"):
        Engine(backend, NoDrafter(), scheduler="dspark")
    engine = Engine(backend, NoDrafter(), max_context=32)
    with pytest.raises(DsparkError, match="context window"):
        engine.add(Request(torch.arange(3, 30), max_new_tokens=10))
    with pytest.raises(DsparkError, match="max_new_tokens"):
        engine.add(Request(torch.arange(3, 8), max_new_tokens=0))
    with pytest.raises(DsparkError, match="non-empty"):
        engine.add(Request(torch.empty(0, dtype=torch.long), max_new_tokens=4))


def test_eos_stops_one_request_and_not_the_others():
    model = tiny_model("llama", num_layers=3)
    engine = Engine(make_backend(model, max_slots=2), NgramDrafter(max_ngram=2), block_size=3)
    a, b = prompts(2, seed=5)
    free_running = hf_greedy(model, a, 16)
    eos = free_running[5]
    stopping = Request(a, max_new_tokens=16, eos_token_ids=frozenset({eos}))
    other = Request(b, max_new_tokens=16)
    engine.run([stopping, other])
    assert stopping.finish_reason == "stop" and stopping.output_ids == free_running[: free_running.index(eos) + 1]
    assert other.output_ids == hf_greedy(model, b, 16)


# ---------------------------------------------------------------------------- losslessness


class ConfidentMarkovDrafter(MarkovDrafter):
    """Markov drafts with a confidence c_k = max q_k: it depends on x_{<k} only, like the real head."""

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        draft = super().propose(state, context, num_tokens, sampling, generator)
        if not len(draft):
            return draft
        return Draft(draft.tokens, draft.q, draft.q.max(-1).values)


def concurrent_samples(target_table, drafter, params, num_requests, num_tokens, scheduler="dspark", seed=0):
    """Outputs of `num_requests` requests run 4 at a time, each with its own seeded generator."""
    backend = SerialBackend([MarkovTarget(target_table) for _ in range(4)])
    steep = SPSTable(tuple(1.0 / (1.0 + 0.12 * b) for b in range(1, 40)))
    engine = Engine(backend, drafter, block_size=4, scheduler=scheduler, sps=steep)
    requests = [Request(torch.tensor([0]), num_tokens, params, make_generator(seed * 100_000 + i))
                for i in range(num_requests)]
    engine.run(requests)
    return torch.tensor([r.output_ids for r in requests]), engine


@pytest.mark.parametrize("scheduler", ["dspark", "dspark-async", "threshold-0.3"])
def test_concurrent_scheduled_sampling_is_lossless(scheduler):
    target_table, draft_table = random_tables(8, seed=3)
    params = SamplingParams(temperature=1.0)
    outputs, engine = concurrent_samples(target_table, ConfidentMarkovDrafter(draft_table), params, 3000, 4,
                                         scheduler)
    assert 0.3 < engine.stats.verified_per_request < 3.5  # the scheduler really cut drafts, and not all of them
    marginals = exact_marginals(target_table, 0, params, 4)
    pvalues = [chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(4)]
    assert min(pvalues) > ALPHA, pvalues


def test_concurrent_negative_control_fails(monkeypatch):
    from test_lossless import always_accept

    monkeypatch.setattr(engine_module, "verify", always_accept)
    target_table, draft_table = random_tables(8, seed=3)
    params = SamplingParams(temperature=1.0)
    outputs, _ = concurrent_samples(target_table, ConfidentMarkovDrafter(draft_table), params, 3000, 4)
    marginals = exact_marginals(target_table, 0, params, 4)
    assert min(chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(1, 4)) < ALPHA



class CountingDrafter(MarkovDrafter):
    """Markov drafts with one fixed confidence for every position; counts the proposals it makes."""

    def __init__(self, table: torch.Tensor, confidence: float) -> None:
        super().__init__(table)
        self.fixed_confidence, self.proposals = confidence, 0

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        draft = super().propose(state, context, num_tokens, sampling, generator)
        self.proposals += bool(len(draft))
        return Draft(draft.tokens, draft.q, torch.full((len(draft),), self.fixed_confidence)) if len(draft) else draft


@pytest.mark.parametrize("confidence", [0.001, 0.99])
def test_dspark_async_skips_drafting_when_its_capacity_is_zero(confidence):
    """With hopeless confidences the capacity K is 0, so dspark-async drafts only to probe (once per
    PROBE_EVERY rounds) and the output is still the target's greedy chain; a perfect, confident drafter
    drafts every round."""
    target_table, draft_table = random_tables(8, seed=3)
    drafter = CountingDrafter(draft_table if confidence < 0.5 else target_table, confidence)
    steep = SPSTable(tuple(1.0 / (1.0 + 0.5 * b) for b in range(1, 40)))
    engine = Engine(SerialBackend([MarkovTarget(target_table)]), drafter, block_size=4, scheduler="dspark-async",
                    sps=steep)
    request = Request(torch.tensor([0]), 60, SamplingParams())
    engine.run([request])
    reference = Request(torch.tensor([0]), 60, SamplingParams())
    Engine(SerialBackend([MarkovTarget(target_table)]), NoDrafter(), block_size=4).run([reference])
    assert request.output_ids == reference.output_ids
    rounds = engine.scheduler_state.round
    if confidence < 0.5:
        assert rounds == 59  # nothing verified: the prefill emits one token, every round one more
        assert rounds // (PROBE_EVERY + 1) <= drafter.proposals <= 2 + rounds // PROBE_EVERY
    else:
        assert drafter.proposals >= rounds - 1 and rounds < 30  # the last round may have no tokens left to draft


class PromptConfidenceDrafter(MarkovDrafter):
    """Confident (0.99) for requests whose prompt starts with token 0, hopeless (0.001) for the others; counts
    the proposals per first prompt token."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(table)
        self.proposals: dict[int, int] = {}

    def propose(self, state, context, num_tokens, sampling, generator) -> Draft:
        draft = super().propose(state, context, num_tokens, sampling, generator)
        if not len(draft):
            return draft
        first = int(context[0])
        self.proposals[first] = self.proposals.get(first, 0) + 1
        return Draft(draft.tokens, draft.q, torch.full((len(draft),), 0.99 if first == 0 else 0.001))


class FreeLookupDrafter(PromptConfidenceDrafter):
    """As PromptConfidenceDrafter, and the hopeless request's drafts cost nothing (as a lookup hit's)."""

    def drafts_for_free(self, state, context) -> bool:
        return int(context[0]) != 0


@pytest.mark.parametrize("scheduler", ["dspark-async", "dspark-planned"])
@pytest.mark.parametrize("free", [False, True], ids=["model-drafts", "free-drafts"])
def test_planning_schedulers_draft_only_for_requests_they_will_verify(scheduler, free):
    """Two requests decoded together: the confident one drafts every round, the hopeless one only to probe
    (unless its drafts are free: then every round), and both outputs are still the target's greedy chains."""
    target_table, _ = random_tables(8, seed=3)
    drafter = (FreeLookupDrafter if free else PromptConfidenceDrafter)(target_table)
    steep = SPSTable(tuple(1.0 / (1.0 + 0.05 * b) for b in range(1, 40)))
    engine = Engine(SerialBackend([MarkovTarget(target_table) for _ in range(2)]), drafter, block_size=4,
                    scheduler=scheduler, sps=steep)
    requests = [Request(torch.tensor([first, 3]), 60, SamplingParams()) for first in (0, 1)]
    engine.run(requests)
    for request in requests:
        reference = Request(request.prompt_ids.clone(), 60, SamplingParams())
        Engine(SerialBackend([MarkovTarget(target_table)]), NoDrafter(), block_size=4).run([reference])
        assert request.output_ids == reference.output_ids
    confident, hopeless = (r.stats.num_rounds for r in requests)
    assert drafter.proposals[0] >= confident - 2 and confident < 20  # the last round may have no tokens to draft
    if free:
        assert drafter.proposals[1] >= hopeless - 1
    else:
        assert drafter.proposals[1] <= 2 + hopeless // PROBE_EVERY < hopeless // 4


def closed_gate(num_requests: int = 1) -> DraftGate:
    """A gate that measured plain rounds 100x faster than drafting ones at `num_requests` (and explores only after
    1000 rounds)."""
    gate = DraftGate(min_rounds=2, explore_every=1000)
    for drafted, seconds in ((True, 1.0), (True, 1.0), (False, 0.01), (False, 0.01)):
        gate.record(num_requests, drafted, 1, seconds)
    return gate


@pytest.mark.parametrize("case", ["greedy", "seeded", "free"])
def test_a_closed_draft_gate_skips_drafting_except_seeded_drafts(case):
    """Where plain decoding measured faster the gate stops drafting, lookup hits ("free" drafts) included (the
    output is still the target's greedy chain, and every decode round is measured, the prefill round not); a
    seeded sampled request still drafts as its scheduler says (the same seed draws the same tokens whatever the
    timings)."""
    target_table, draft_table = random_tables(8, seed=3)
    drafter = FreeLookupDrafter(target_table) if case == "free" else CountingDrafter(target_table, 0.99)
    gate = closed_gate()
    engine = Engine(SerialBackend([MarkovTarget(target_table)]), drafter, block_size=4, scheduler="dspark",
                    sps=SPSTable(tuple(1.0 / (1.0 + 0.05 * b) for b in range(1, 40))), gate=gate)
    seeded = case == "seeded"
    params = SamplingParams(temperature=1.0) if seeded else SamplingParams()
    request = Request(torch.tensor([1, 3]), 30, params, make_generator(5) if seeded else None, reproducible=seeded)
    engine.run([request])
    proposals = drafter.proposals if case != "free" else sum(drafter.proposals.values())
    if case in ("greedy", "free"):
        assert proposals == 0 and sum(request.stats.drafted_per_round) == 0
        reference = Request(torch.tensor([1, 3]), 30, SamplingParams())
        Engine(SerialBackend([MarkovTarget(target_table)]), NoDrafter(), block_size=4).run([reference])
        assert request.output_ids == reference.output_ids
        assert gate.summary()[1]["plain_rounds"] == 2 + 29  # 30 tokens: the prefill's, then one per round
    else:
        assert proposals >= request.stats.num_rounds - 1 > 0


def test_a_closed_gate_verifies_no_lookup_draft_and_measures_every_plain_round():
    """A plain round in which one request verifies a lookup draft costs more than plain decoding for little more
    (session 28: one row's lookup made a round of 8 requests ~20% slower): a closed gate verifies none, so each of
    its rounds is a plain one and measured as such."""
    target_table, _ = random_tables(8, seed=3)
    drafter = FreeLookupDrafter(target_table)  # the request starting with 1 drafts for free, the one with 0 not
    gate = closed_gate(num_requests=2)
    gate.trace = []
    engine = Engine(SerialBackend([MarkovTarget(target_table) for _ in range(2)]), drafter, block_size=4,
                    scheduler="dspark", sps=SPSTable(tuple(1.0 / (1.0 + 0.05 * b) for b in range(1, 40))), gate=gate)
    asked_while_open = []  # a closed round does not even look for lookup hits
    look = drafter.drafts_for_free
    drafter.drafts_for_free = lambda state, context: asked_while_open.append(engine._gate_open) or look(state, context)
    requests = [Request(torch.tensor([first, 3]), 30) for first in (0, 1)]
    engine.run(requests)
    assert False not in asked_while_open  # the old engine searched every request in each of the 29 closed rounds
    at_two = [row for row in gate.trace if row["num_requests"] == 2]
    assert len(at_two) == 29 and all("unmeasured" not in row and not row["drafted"] for row in at_two)
    assert gate.summary()[2]["plain_rounds"] == 2 + 29
    assert sum(drafter.proposals.values()) == 0 and all(sum(r.stats.drafted_per_round) == 0 for r in requests)


def test_the_gate_does_not_measure_a_round_whose_drafter_catches_up_on_the_prompt():
    """A DSpark drafter absorbs a request's prompt features at its first draft (a lazy commit): that round costs
    what a drafting round does not, so the gate records only the rounds after it."""
    model = tiny_model("llama", num_layers=2)
    drafter = random_dspark(model)
    gate = DraftGate(min_rounds=1000)  # drafting every round: measuring
    engine = Engine(make_backend(model, drafter.target_layer_ids, max_slots=1), drafter, block_size=4,
                    scheduler="dspark", sps=SPSTable(tuple(1.0 / (1.0 + 0.01 * b) for b in range(1, 40))), gate=gate)
    prompt = torch.arange(3, 15)  # 12 prompt positions > γ + 1
    request = Request(prompt, 20)
    engine.run([request])
    assert request.stats.num_rounds >= 2
    assert gate.summary()[1]["draft_rounds"] == request.stats.num_rounds - 1


def test_a_lookup_hit_is_not_counted_as_the_model_drafter_catching_up():
    """A lookup hit runs no model, so the model's backlog (here the whole prompt) is not absorbed in its round:
    that round is 'free' in the gate's trace, not 'catch-up' (session 17 read plain rounds with lookup hits at
    8 requests as catch-up work)."""
    model = tiny_model("llama", num_layers=2)
    drafter = LookupFirstDrafter(random_dspark(model))
    gate = DraftGate(min_rounds=1000, trace=[])
    engine = Engine(make_backend(model, drafter.target_layer_ids, max_slots=1), drafter, block_size=4,
                    scheduler="dspark", sps=SPSTable(tuple(1.0 / (1.0 + 0.01 * b) for b in range(1, 40))), gate=gate)
    # "4 5 v" for every token v, then "4 5": whatever the prefill emits, the context ends in a 3-gram seen before
    prompt = torch.tensor([t for v in range(VOCAB) for t in (4, 5, v)] + [4, 5])
    assert all(len(ngram_lookup(torch.cat([prompt, torch.tensor([v])]), 4, 4, 3)) for v in range(VOCAB))
    engine.add(Request(prompt, 8))
    engine.step()  # the prefill
    engine.step()  # the first decode round: a lookup draft, the model's prompt backlog untouched
    assert gate.trace[-1]["unmeasured"] == "free"


class SpyGate(DraftGate):
    """A draft gate that remembers how the engine asked it."""

    def __init__(self) -> None:
        super().__init__(min_rounds=1)
        self.asked: list[tuple[int, bool]] = []

    def should_draft(self, num_requests: int, measured: bool = True) -> bool:
        self.asked.append((num_requests, measured))
        return super().should_draft(num_requests, measured)


def test_the_engine_tells_the_gate_which_rounds_it_cannot_measure():
    """A round that also carries a prompt chunk is not recorded, and the gate is told so before it decides."""
    target_table, _ = random_tables(8, seed=3)
    gate = SpyGate()
    engine = Engine(SerialBackend([MarkovTarget(target_table) for _ in range(2)]), CountingDrafter(target_table, 0.9),
                    block_size=4, scheduler="dspark", sps=SPSTable(tuple(1.0 / (1.0 + 0.05 * b) for b in range(1, 40))),
                    prefill_chunk=4, gate=gate)
    short, long = Request(torch.tensor([1, 3]), 40), Request(torch.arange(12) % 8, 12)
    engine.run([short, long])
    # prompt chunks of 4 tokens in all per round: 2 + 2, then the long prompt's 4, 4, 2 beside the short's decode
    assert gate.asked[:3] == [(1, False)] * 3
    assert gate.asked[3] == (2, True) and all(measured for r, measured in gate.asked[3:])
    measured_rounds = sum(s["draft_rounds"] + s["plain_rounds"] for s in gate.summary().values())
    assert measured_rounds == len(gate.asked) - 3  # every decode-only round, none of the three


def test_the_gate_is_given_the_tokens_a_round_expects_from_its_confidences():
    """Per request 1 + Σ a_k over the verified drafts; what it committed where no draft or no confidences."""
    a, b, c = (Request(torch.tensor([1]), 4) for _ in range(3))
    confident = Draft(torch.tensor([5, 6]), None, torch.tensor([0.5, 0.5]))  # a = 0.5, 0.25
    no_confidence = Draft(torch.tensor([5, 6, 7]))
    rounds = [(a, confident), (b, no_confidence), (c, Draft.empty())]
    events = [(a, [5]), (b, [5, 6, 7, 8]), (c, [9])]
    assert expected_tokens(rounds, events) == pytest.approx(1.75 + 4 + 1)
    assert expected_tokens(rounds, events, free={id(b)}) == pytest.approx(1.75 + 1 + 1)  # a lookup hit counts 1


class AlternatingGate:
    """Drafts every other round, whatever the timings: decisions that read no draft."""

    def __init__(self) -> None:
        self.rounds = 0

    def should_draft(self, num_requests: int, measured: bool = True) -> bool:
        self.rounds += 1
        return self.rounds % 2 == 0

    def record(self, num_requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        pass

    def unmeasured(self, num_requests: int, drafted: bool, reason: str, seconds: float) -> None:
        pass


def test_gated_sampling_is_lossless():
    """Rounds that skip drafting (gate closed) between rounds that draft keep the target's distribution."""
    target_table, draft_table = random_tables(8, seed=3)
    params = SamplingParams(temperature=1.0)
    backend = SerialBackend([MarkovTarget(target_table) for _ in range(4)])
    engine = Engine(backend, ConfidentMarkovDrafter(draft_table), block_size=4, scheduler="dspark",
                    sps=SPSTable(tuple(1.0 / (1.0 + 0.12 * b) for b in range(1, 40))), gate=AlternatingGate())
    requests = [Request(torch.tensor([0]), 4, params, make_generator(i)) for i in range(3000)]
    engine.run(requests)
    outputs = torch.tensor([r.output_ids for r in requests])
    assert 0 < engine.stats.num_verified < 3 * 3000
    marginals = exact_marginals(target_table, 0, params, 4)
    assert min(chi_square_pvalue(outputs[:, j], marginals[j]) for j in range(4)) > ALPHA


def test_an_idle_engine_reproduces_a_seeded_sampled_request_under_dspark_async():
    """dspark-async schedules from the rounds before; an engine that has drained forgets them, so the same
    seeded sampled request run again alone draws the same tokens (the server's `seed` relies on it)."""
    target_table, draft_table = random_tables(8, seed=3)
    steep = SPSTable(tuple(1.0 / (1.0 + 0.12 * b) for b in range(1, 40)))
    engine = Engine(SerialBackend([MarkovTarget(target_table)]), ConfidentMarkovDrafter(draft_table), block_size=4,
                    scheduler="dspark-async", sps=steep)
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(3):
        request = Request(torch.tensor([0]), 40, params, make_generator(7))
        engine.run([request])
        runs.append(request.output_ids)
    assert runs[0] == runs[1] == runs[2]


# ---------------------------------------------------------------------------- fault isolation


def engine_with(drafter_kind: str, max_slots: int = 4):
    model = tiny_model("llama", num_layers=3)
    drafter = {"dspark": lambda: random_dspark(model), "ngram": lambda: NgramDrafter(max_ngram=2),
               "none": NoDrafter}[drafter_kind]()
    return model, Engine(make_backend(model, drafter.target_layer_ids, max_slots=max_slots), drafter, block_size=4)


@pytest.mark.parametrize("drafter_kind", ["dspark", "ngram", "none"])
def test_a_request_whose_sampling_fails_ends_alone(drafter_kind):
    """temperature 1e-40 turns logits into inf and probabilities into NaN: torch.multinomial raises.
    Before, one such request failed every request of the round; now it fails alone."""
    model, engine = engine_with(drafter_kind)
    first, second, third = prompts(3, seed=6)
    healthy = [Request(first, 14), Request(second, 14)]
    doomed = Request(third, 14, SamplingParams(temperature=1e-40), make_generator(0))
    engine.run([healthy[0], doomed, healthy[1]])
    assert doomed.finish_reason == "error" and doomed.error is not None and doomed.output_ids == []
    assert "sampling" in str(doomed.error) and "probability" not in str(doomed.error)  # torch's words stay in the log
    for request in healthy:
        assert request.finish_reason == "length"
        assert request.output_ids == hf_greedy(model, request.prompt_ids, 14)
    assert not engine.running and len(engine.backend.free) == 4


def test_a_failed_batched_proposal_is_redone_without_the_request_at_fault():
    """The batched DSpark proposal fails mid-generation because of one request (after the others'
    generators were drawn from): that request fails, the proposal is redone for the others from
    their saved generator states, so even their sampled outputs equal a run without it."""

    def outputs(with_doomed: bool) -> tuple[list[list[int]], Request]:
        model, engine = engine_with("dspark")
        first, second, third = prompts(3, seed=7)
        greedy = Request(first, 16)
        sampled = Request(second, 16, SamplingParams(temperature=1.0), make_generator(11))
        doomed = Request(third, 16)
        real = engine.drafter.propose_batch

        def failing(states, *args):
            drafts = real(states, *args)  # draws from every generator first
            if doomed.drafter_state in states and len(doomed.output_ids) >= 5:
                raise RuntimeError("injected drafter failure")
            return drafts

        engine.drafter.propose_batch = failing
        engine.run([greedy, sampled, doomed] if with_doomed else [greedy, sampled])
        assert greedy.output_ids == hf_greedy(model, first, 16)
        return [greedy.output_ids, sampled.output_ids], doomed

    alone, _ = outputs(with_doomed=False)
    together, doomed = outputs(with_doomed=True)
    assert doomed.finish_reason == "error" and "drafting" in str(doomed.error) and len(doomed.output_ids) >= 5
    assert together == alone


@pytest.mark.parametrize("fail_after_writing", [False, True])
def test_a_failing_forward_sheds_the_largest_request_and_redoes_the_round(fail_after_writing):
    """A forward that runs out of memory (simulated: more than 60 tokens of cache in one forward)
    sheds the request holding the most KV cache, rolls the others' slots back (even after the forward
    has written them) and redoes the forward: the others' outputs are exactly HF's."""
    model, engine = engine_with("dspark")
    backend = engine.backend
    real = backend.forward

    def forward(segments):
        held = sum(backend.length(s.slot) + s.token_ids.shape[0] for s in segments)
        if held > 60:
            if fail_after_writing:
                real(segments)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(segments)

    backend.forward = forward
    short = [Request(p[:4], 12) for p in prompts(3, seed=8)]  # at most 3 x 16 tokens of cache: they fit
    long = Request(torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(9)), 40)
    engine.run([*short, long])
    assert long.finish_reason == "error" and long.error.out_of_memory and long.output_ids
    for request in short:
        assert request.finish_reason == "length" and request.output_ids == hf_greedy(model, request.prompt_ids, 12)
    assert not engine.running and len(backend.free) == 4


def test_slot_cache_growth_is_all_or_nothing(monkeypatch):
    from dspark import ragged

    cache = ragged.SlotCache(3, 2, 2, 4, torch.float32, torch.device("cpu"), capacity=8)
    with torch.inference_mode():  # the cache holds inference tensors (forwards write it in inference mode)
        cache.keys[1][0, :, :5] = 1.0
    calls = {"n": 0}
    real = ragged._resized

    def fails_on_the_fourth(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("simulated")
        return real(*args)

    monkeypatch.setattr(ragged, "_resized", fails_on_the_fourth)
    with pytest.raises(torch.OutOfMemoryError):
        cache.reserve(20)
    assert {t.shape[2] for t in cache.keys + cache.values} == {8}  # no layer grew alone
    assert cache.keys[1][0, :, :5].eq(1.0).all()
    cache.reserve(20)
    assert {t.shape[2] for t in cache.keys + cache.values} == {20} and cache.keys[1][0, :, :5].eq(1.0).all()


def test_kv_capacity_is_reclaimed_when_long_requests_finish():
    """One 300-token request grows every slot's capacity; once it has finished the cache shrinks
    back, and a request decoding across the shrink still gets exactly HF's output."""
    model = tiny_model("llama", num_layers=3)
    engine = Engine(make_backend(model, max_slots=2), NoDrafter(), block_size=0)
    cache = engine.backend.cache
    start = cache.capacity
    long = Request(torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(1)), 2)
    short = Request(prompts(1, seed=2)[0], 30)
    engine.add(long)
    engine.add(short)
    grown = 0
    while engine.has_work:
        engine.step()
        grown = max(grown, cache.capacity)
    assert grown >= 2 * start and cache.capacity == start
    assert short.output_ids == hf_greedy(model, short.prompt_ids, 30)
