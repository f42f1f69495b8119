"""The DSpark drafter's compiled round (`dspark.drafters.compiled_block`, `--compile`): it drafts what the eager
round drafts (greedy chain, confidences; sampled requests from its block with the eager head), one request's round
projects its committed positions into its cache as the eager flush does, three graphs whatever the contexts, lengths,
capacities or positions absorbed, keeps greedy speculative decoding identical to vanilla decoding, and falls back to
the eager round when compiling fails. One tiny drafter per module: compiling is the slow part."""

import shutil

import pytest
import torch
from test_dspark_drafter import DRAFT_IDS, VOCAB, features, make_model, tiny_target
from torch._dynamo.utils import counters

from dspark.compiled import CompiledRunner
from dspark.drafters import compiled_block as block_module
from dspark.drafters.compiled_block import transition_table
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.drafters.lookup_first import LookupFirstDrafter
from dspark.engine import Engine, Request
from dspark.profiling import drafter_tag
from dspark.ragged import RaggedBackend
from dspark.sampling import SamplingParams, make_generator

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile on a CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=5)


@pytest.fixture(scope="module")
def drafters(target):
    """(eager, compiled) drafters on one model: a stateful sequential head, a reduced vocabulary and the last
    context input, the paths the graph must carry."""
    model = make_model(target, "rnn", block_size=5, draft_ids=DRAFT_IDS, last_context_input=True)
    eager = DSparkDrafter(model)
    return eager, eager.compiled()


@pytest.fixture(scope="module")
def vanilla(target):
    """(eager, compiled) drafters with the default drafter's head: memoryless Markov over a reduced vocabulary, whose
    compiled greedy chain reads a transition table."""
    eager = DSparkDrafter(make_model(target, "vanilla", block_size=4, seed=8, draft_ids=DRAFT_IDS))
    return eager, eager.compiled()


def contexts_and_states(target, drafter, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n + 1,), generator=generator) for n in lengths]
    states = [drafter.start(i[:-1], features(target, i[None])[0, :-1]) for i in ids]
    return ids, states


def test_the_compiled_round_drafts_what_the_eager_round_does(target, drafters):
    eager, compiled = drafters
    assert compiled.drafts_compiled and not eager.drafts_compiled and compiled.model is eager.model
    assert drafter_tag(compiled) != drafter_tag(eager)  # profiled apart: another price
    greedy = SamplingParams()
    graphs = []
    # one request and several, contexts of different lengths, caches past their first capacity (64)
    for lengths, counts in (((9,), (5,)), ((30, 9, 70), (5, 2, 4)), ((100,), (3,)), ((12, 140), (5, 5))):
        ids, states = contexts_and_states(target, eager, lengths, seed=len(lengths))
        args = (states, ids, list(counts), [greedy] * len(ids), [None] * len(ids))
        want, got = eager.propose_batch(*args), compiled.propose_batch(*args)
        for a, b, n in zip(want, got, counts, strict=True):
            assert len(b) == n and torch.equal(a.tokens, b.tokens) and b.q is None
            torch.testing.assert_close(b.confidence, a.confidence, atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
        for state in states:  # past the length the buffers hold zeros: the graph reads them under a mask, and a
            cache = state.cache  # masked NaN of uninitialised memory would still reach its output (0 · NaN)
            assert all((buffer[:, :, cache.length:] == 0).all() for buffer in cache.keys + cache.values)
    assert graphs[1] == graphs[2] == graphs[3] and compiled.block.failed is None  # two graphs, then none


def test_sampled_requests_draw_from_the_compiled_block_with_the_eager_head(target, drafters):
    """q must be exactly what each token was drawn from: sampled rows take the graph's hidden states and base
    logits through the eager sequential head, beside a greedy row in the same round."""
    eager, compiled = drafters
    ids, states = contexts_and_states(target, eager, (20, 41), seed=7)
    samplings = [SamplingParams(temperature=0.9, top_k=12), SamplingParams()]
    want = eager.propose_batch(states, ids, [5, 4], samplings, [make_generator(3), None])
    got = compiled.propose_batch(states, ids, [5, 4], samplings, [make_generator(3), None])
    assert torch.equal(got[0].tokens, want[0].tokens) and torch.equal(got[1].tokens, want[1].tokens)
    torch.testing.assert_close(got[0].q, want[0].q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[0].q.sum(-1), torch.ones(5))
    assert (got[0].q[torch.arange(5), got[0].tokens] > 0).all() and got[1].q is None


def test_greedy_speculative_decoding_with_the_compiled_round_is_vanilla_decoding(target, drafters):
    eager, compiled = drafters
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(11))

    def generate(drafter, block_size):
        engine = Engine(RaggedBackend(target, drafter.target_layer_ids), drafter, block_size=block_size)
        request = Request(prompt, 30)
        return [t for chunk in engine.stream(request) for t in chunk]

    assert generate(compiled, 5) == generate(eager, 0)
    wrapped = LookupFirstDrafter(eager).compiled()  # the default drafter's shape: lookup first, then the model
    assert wrapped.drafts_compiled and wrapped.model.block is compiled.block
    assert generate(wrapped, 5) == generate(eager, 0)


def test_one_requests_round_absorbs_its_committed_positions_as_the_eager_flush_does(target, drafters, monkeypatch):
    """At one request the graph projects the positions committed since the last draft into the cache itself (the
    first round's whole prompt into an empty cache, then one position, given twice at one place, and several):
    the drafts, the cache's keys, values and length, and the last context equal the eager round's."""
    eager, compiled = drafters
    greedy = SamplingParams()
    flushed = []  # rounds that projected eagerly: the compiled drafter's must not
    project = eager.model.extend_contexts
    monkeypatch.setattr(eager.model, "extend_contexts", lambda *args: flushed.append(1) or project(*args))
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(4))
    hidden = features(target, ids[None])[0]
    states = {d: d.start(ids[:20], hidden[:20]) for d in (eager, compiled)}
    length = 20
    for step in (0, 1, 3, 6):  # positions committed since the last round (none in the first: the prompt waits)
        if step:
            for drafter, state in states.items():
                drafter.commit(state, hidden[length : length + step])
            length += step
        context = ids[: length + 1]
        want = eager.propose_batch([states[eager]], [context], [5], [greedy], [None])[0]
        before = len(flushed)
        got = compiled.propose_batch([states[compiled]], [context], [5], [greedy], [None])[0]
        assert len(flushed) == before > 0  # the eager round projected; the compiled one did in its graph
        assert torch.equal(want.tokens, got.tokens)
        torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-5)
        a, b = states[eager], states[compiled]
        assert a.cache.length == b.cache.length == length and a.num_pending == b.num_pending == 0
        torch.testing.assert_close(b.cache.last_context, a.cache.last_context, atol=1e-5, rtol=1e-5)
        for x, y in zip(a.cache.keys + a.cache.values, b.cache.keys + b.cache.values, strict=True):
            torch.testing.assert_close(y[:, :, :length], x[:, :, :length], atol=1e-5, rtol=1e-5)
            assert (y[:, :, length:] == 0).all()  # nothing written past the length
    assert compiled.block.failed is None


def test_the_transition_table_holds_the_markov_heads_bias_after_each_draft_id(target):
    model = make_model(target, "vanilla", draft_ids=DRAFT_IDS)
    table = transition_table(model)
    assert table.shape == (len(DRAFT_IDS), len(DRAFT_IDS))
    for j in (0, 17, len(DRAFT_IDS) - 1):  # row j: the bias after draft id j, i.e. after target id DRAFT_IDS[j]
        bias, _ = model.markov_head.step(None, DRAFT_IDS[j : j + 1], None)
        torch.testing.assert_close(table[j], bias[0])
    assert transition_table(make_model(target, "rnn", draft_ids=DRAFT_IDS)) is None  # stateful: no table
    assert transition_table(make_model(target, "gated")) is None  # reads the hidden state
    assert transition_table(make_model(target, None)) is None


def test_a_table_over_its_size_limit_keeps_the_rank_r_chain(target, monkeypatch):
    model = make_model(target, "vanilla")  # full vocabulary: 96 × 96 float32
    assert transition_table(model) is not None
    monkeypatch.setattr(block_module, "MAX_TRANSITION_BYTES", VOCAB * VOCAB * 4 - 1)
    assert transition_table(model) is None


def test_the_compiled_chain_through_the_transition_table_drafts_what_the_eager_round_does(target, vanilla):
    eager, compiled = vanilla
    assert compiled.block.module.transition is not None and eager.block is None
    greedy = SamplingParams()
    for lengths, counts in (((9,), (4,)), ((30, 9, 70), (4, 2, 3)), ((100,), (4,))):
        ids, states = contexts_and_states(target, eager, lengths, seed=len(lengths) + 20)
        args = (states, ids, list(counts), [greedy] * len(ids), [None] * len(ids))
        want, got = eager.propose_batch(*args), compiled.propose_batch(*args)
        for a, b, n in zip(want, got, counts, strict=True):
            assert len(b) == n and torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(b.confidence, a.confidence, atol=1e-5, rtol=1e-5)
    assert compiled.block.failed is None


def test_warm_up_compiles_every_graph(target, vanilla):
    """A server warms the drafter up before it listens: afterwards no round compiles, whether one request absorbs
    one committed position, several, a whole prompt or none, or several requests draft together."""
    eager, drafter = vanilla
    model = eager.model
    assert DSparkDrafter(model).warm_up() == 0  # not compiled: nothing to do
    assert drafter.warm_up() == 3
    before = counters["stats"]["unique_graphs"]
    greedy = SamplingParams()
    for lengths in ((15,), (80, 3), (7, 30, 66)):
        ids, states = contexts_and_states(target, drafter, lengths, seed=sum(lengths))
        drafter.propose_batch(states, ids, [4] * len(ids), [greedy] * len(ids), [None] * len(ids))
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(9))
    hidden = features(target, ids[None])[0]
    state, length = drafter.start(ids[:12], hidden[:12]), 12
    for step in (0, 1, 0, 2, 5):  # the last ones from a target of another dtype (warm_up's features are float32)
        drafter.commit(state, hidden[length : length + step].to(torch.bfloat16 if step > 1 else hidden.dtype))
        length += step
        drafter.propose_batch([state], [ids[: length + 1]], [4], [greedy], [None])
    assert counters["stats"]["unique_graphs"] == before and drafter.block.failed is None


def test_a_compile_failure_drafts_the_eager_way_and_says_why(target, drafters, monkeypatch, capsys):
    eager, compiled = drafters
    fresh = CompiledRunner(compiled.block.module, "compiled draft")  # not the shared runner: other tests keep it
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("InductorError: no C++ compiler\ndetails")

    monkeypatch.setattr(fresh, "compiled", broken)
    compiled = DSparkDrafter(eager.model)
    compiled.block = fresh
    ids, states = contexts_and_states(target, eager, (10, 25), seed=2)
    args = (states, ids, [5, 5], [SamplingParams()] * 2, [None] * 2)
    for _ in range(2):
        want, got = eager.propose_batch(*args), compiled.propose_batch(*args)
        assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.confidence, b.confidence)
                   for a, b in zip(want, got, strict=True))  # the eager round itself, bit for bit
    assert len(calls) == 1
    assert "compiled draft unavailable (RuntimeError: InductorError: no C++ compiler); running eager" in (
        capsys.readouterr().err)
