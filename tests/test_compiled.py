"""The compiled one-request forward (`dspark.compiled`, `--compile`): it computes what the eager ragged forward
computes (logits, target features, cache), survives the cache growing under it without failing, keeps greedy
speculative decoding identical to vanilla decoding with the same forward, and falls back to eager when compiling
fails. One tiny model per test module: compiling is the slow part (one graph for one token, one for more)."""

import inspect
import shutil

import pytest
import torch
from conftest import VOCAB, tiny_model
from torch._dynamo.utils import counters

from dspark.compiled import CompiledRunner, compilable
from dspark.drafters.base import NoDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine, Request
from dspark.ragged import RaggedBackend, Segment, round_layouts

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile on a CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=3)


def test_compiled_forward_computes_what_the_eager_one_does(llama):
    layer_ids = (-1, 0, 1)  # embeddings, a middle layer and the last (HF's: after the final norm)
    eager = RaggedBackend(llama, layer_ids, max_slots=2)
    compiled = RaggedBackend(llama, layer_ids, max_slots=2, compile=True)
    assert compiled.compiled is not None and compiled.compiled.max_tokens >= 8
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (250,), generator=generator)  # a prompt chunk: compiled as well
    slots = {}
    for name, backend in (("eager", eager), ("compiled", compiled)):
        backend.allocate()  # slot 0 stays empty: the compiled forward must write and read slot 1
        slots[name] = backend.allocate()
        backend.forward([Segment(slots[name], prompt, "none")])
    for size in (1, 3, 1, 8, 1, 1, 2):  # crosses the cache's initial capacity (256) on the way
        block = torch.randint(3, VOCAB, (size,), generator=generator)
        want = eager.forward([Segment(slots["eager"], block, "all")])[0]
        got = compiled.forward([Segment(slots["compiled"], block, "all")])[0]
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-4, rtol=1e-4)
        assert compiled.length(slots["compiled"]) == eager.length(slots["eager"])
    assert compiled.cache.capacity > 256 and compiled.compiled.failed is None
    # a rollback is a length: the same block after it gives the same logits; "last" keeps one row
    length = compiled.length(slots["compiled"])
    block = torch.randint(3, VOCAB, (4,), generator=generator)
    first = compiled.forward([Segment(slots["compiled"], block, "all")])[0].logits
    compiled.rollback(slots["compiled"], length)
    last = compiled.forward([Segment(slots["compiled"], block, "last")])[0].logits
    torch.testing.assert_close(last, first[-1:])


def test_every_slot_shares_the_compiled_graphs(llama):
    """A server decodes in whichever slot a request holds: a slot must not be a guard (it was, a graph per slot,
    and past dynamo's 8 graphs the rest ran eager; then slot 0 had its own pair)."""
    layer_ids = (-1, 0, 1)  # the first test's compilation, shared through the model
    eager = RaggedBackend(llama, layer_ids, max_slots=4)
    compiled = RaggedBackend(llama, layer_ids, max_slots=4, compile=True)
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    for backend in (eager, compiled):
        assert [backend.allocate() for _ in range(4)] == [0, 1, 2, 3]
    graphs = []
    for slot in (1, 2, 0, 3):
        for backend in (eager, compiled):
            backend.forward([Segment(slot, prompt, "none")])
        for block in (torch.tensor([5]), torch.tensor([6, 7, 8])):
            want = eager.forward([Segment(slot, block, "all")])[0].logits
            got = compiled.forward([Segment(slot, block, "all")])[0].logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2] == graphs[3] and compiled.compiled.failed is None


def test_warm_up_compiles_every_graph_before_the_first_request():
    """A compiled server warms up before it listens: afterwards no slot, length, step size or round of several
    requests compiles again, and the slots come back free in the order `allocate` hands them out."""
    model = tiny_model("llama", seed=4)  # its own compilation: nothing compiled yet
    eager = RaggedBackend(model, (0, 1), max_slots=4)
    compiled = RaggedBackend(model, (0, 1), max_slots=4, compile=True)
    before = counters["stats"]["unique_graphs"]
    assert compiled.warm_up() == 10  # one request on slot 0, on slot 1; two from slot 0, from slot 1; 1 and 2 tokens;
    # a chunk apart beside a step, on slot 1 and on slot 0
    warmed = counters["stats"]["unique_graphs"]
    assert warmed > before and compiled.free == [3, 2, 1, 0] and compiled.cache.lengths == [0] * 4
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    for backend in (eager, compiled):
        assert [backend.allocate() for _ in range(4)] == [0, 1, 2, 3]
        for slot in range(4):  # prompt chunks run compiled too: asking for no logits or the last row's
            out = backend.forward([Segment(slot, prompt[: 20 + 5 * slot], "last" if slot == 3 else "none")])[0]
            assert out.logits.shape[0] == (slot == 3) and out.hidden.shape[0] == 20 + 5 * slot
    rounds = [{2: 1}, {0: 4}, {1: 1}, {0: 1, 1: 1, 2: 1, 3: 1}, {1: 3, 3: 1}, {0: 2, 2: 5}, {2: 1, 3: 1}, {0: 1, 3: 8},
              {1: 1, 2: 12, 3: 2}, {3: 16, 0: 3}, {0: 20, 2: 1, 3: 1}, {3: 2, 1: 9}]  # the last four: a chunk apart
    assert [len(round_layouts(list(r), [40] * len(r), list(r.values()), 4)) for r in rounds[-5:]] == [1, 2, 2, 2, 2]
    for sizes in rounds:
        segments = [Segment(slot, torch.randint(3, VOCAB, (size,)), "all") for slot, size in sizes.items()]
        want = torch.cat([out.logits for out in eager.forward(segments)])
        got = torch.cat([out.logits for out in compiled.forward(segments)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    single = RaggedBackend(model, (0, 1), max_slots=1, compile=True)  # a one-slot engine (generate) beside a server's
    reference = RaggedBackend(model, (0, 1), max_slots=1)
    for backend in (single, reference):
        backend.forward([Segment(backend.allocate(), prompt, "none")])
    for block in (torch.tensor([5]), torch.tensor([6, 7, 8])):
        want = reference.forward([Segment(0, block, "all")])[0].logits
        torch.testing.assert_close(single.forward([Segment(0, block, "all")])[0].logits, want, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == warmed
    assert compiled.compiled.failed is None


def test_compiled_rounds_of_several_requests_compute_what_the_eager_forward_does(llama, monkeypatch):
    """Rounds of several requests (any slots, contiguous or not, of different lengths and sizes, the cache growing
    past its capacity) give the eager forward's logits, features and cache, and run compiled, a prompt chunk beside
    verify segments too (a round that admits a request used to drop the whole batch to the eager forward); a chunk
    longer than the compiled forward takes runs eager."""
    layer_ids = (-1, 0, 1)
    eager = RaggedBackend(llama, layer_ids, max_slots=4)
    compiled = RaggedBackend(llama, layer_ids, max_slots=4, compile=True)
    calls = []
    run = CompiledRunner.__call__
    monkeypatch.setattr(CompiledRunner, "__call__",
                        lambda self, *args: calls.append(args[0].shape[0]) or run(self, *args))
    monkeypatch.setattr(compiled.compiled, "max_tokens", 24)
    generator = torch.Generator().manual_seed(5)
    for backend in (eager, compiled):
        assert [backend.allocate() for _ in range(4)] == [0, 1, 2, 3]
    for slot, length in enumerate((30, 250, 3, 60)):  # all but 3 tokens longer than the limit: eager
        prompt = torch.randint(3, VOCAB, (length,), generator=generator)
        for backend in (eager, compiled):
            backend.forward([Segment(slot, prompt, "none")])
    assert calls == [3]
    rounds = [{0: 1, 1: 1}, {1: 8, 3: 1}, {0: 3, 2: 3, 3: 2}, {1: 4, 2: 1}, {0: 2, 1: 20, 3: 1}, {1: 1, 3: 1},
              {0: 8, 2: 30}]
    for sizes in rounds:
        segments = [Segment(slot, torch.randint(3, VOCAB, (size,), generator=generator), "last" if size > 16 else "all")
                    for slot, size in sizes.items()]
        want, got = eager.forward(segments), compiled.forward(segments)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g.logits, w.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(g.hidden, w.hidden, atol=1e-4, rtol=1e-4)
    assert calls[1:] == [2, 9, 8, 5, 23, 2]  # every round compiled, the 20-token prompt chunk's too; not 30 tokens
    # with an engine's default settings, every prompt chunk fits the compiled forward
    assert CompiledRunner.max_tokens >= inspect.signature(Engine).parameters["prefill_chunk"].default
    assert eager.cache.lengths == compiled.cache.lengths and compiled.cache.capacity > 256
    for slot, length in enumerate(eager.cache.lengths):
        for ours, theirs in ((compiled.cache.keys, eager.cache.keys), (compiled.cache.values, eager.cache.values)):
            torch.testing.assert_close(ours[1][slot, :, :length], theirs[1][slot, :, :length], atol=1e-4, rtol=1e-4)
    assert compiled.compiled.failed is None


def test_warm_up_refuses_a_busy_backend_and_is_free_without_a_compiled_forward(llama):
    assert RaggedBackend(llama, ()).warm_up() == 0  # eager: nothing to compile
    busy = RaggedBackend(llama, (), max_slots=2, compile=True)
    busy.allocate()
    with pytest.raises(RuntimeError, match="idle"):
        busy.warm_up()


@pytest.mark.parametrize("drafter", [NgramDrafter, NoDrafter], ids=["ngram", "none"])
def test_greedy_speculative_decoding_is_vanilla_decoding_with_the_same_compiled_forward(llama, drafter):
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 11, 5, 6])  # repeats: the n-gram drafter drafts

    def generate(drafter_instance, block_size):
        engine = Engine(RaggedBackend(llama, drafter_instance.target_layer_ids, compile=True), drafter_instance,
                        block_size=block_size)
        request = Request(prompt, 40)
        return [t for chunk in engine.stream(request) for t in chunk], request.stats

    vanilla, _ = generate(NoDrafter(), 0)
    tokens, stats = generate(drafter(), 4)
    assert tokens == vanilla and len(tokens) == 40
    if drafter is NgramDrafter:
        assert stats.tau > 1.0  # drafts were verified, in forwards of several tokens


def test_a_model_the_compiled_forward_does_not_cover_runs_eager(capsys):
    qwen3 = tiny_model("qwen3")  # q/k norms
    backend = RaggedBackend(qwen3, (), compile=True)
    assert not compilable(backend) and backend.compiled is None
    slot = backend.allocate()
    out = backend.forward([Segment(slot, torch.tensor([4, 5, 6]), "last")])[0]
    assert out.logits.shape == (1, VOCAB)


def test_a_compile_failure_falls_back_to_eager_once_and_says_why(llama, monkeypatch, capsys):
    eager = RaggedBackend(llama, ())
    backend = RaggedBackend(llama, (), compile=True)
    runner = backend.compiled
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("InductorError: no C++ compiler\ndetails")

    fresh = CompiledRunner(runner.module)  # not the shared runner: other tests keep theirs
    monkeypatch.setattr(fresh, "compiled", broken)
    backend.compiled = fresh
    for b in (eager, backend):
        b.forward([Segment(b.allocate(), torch.tensor([3, 4, 5, 6]), "none")])
    for _ in range(2):
        block = torch.tensor([7])
        want = eager.forward([Segment(0, block, "all")])[0].logits
        got = backend.forward([Segment(0, block, "all")])[0].logits
        assert torch.equal(got, want)  # the eager forward itself, bit for bit
    assert len(calls) == 1 and "no C++ compiler" in fresh.failed
    assert "compiled forward unavailable (RuntimeError: InductorError: no C++ compiler); running eager" in (
        capsys.readouterr().err)


class _StaticRows(torch.nn.Module):
    """A product whose row count (8) is a constant of the graph, as a drafter block's positions are."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.nn.Parameter(torch.randn(8, 64, generator=generator), requires_grad=False)
        self.weight = torch.nn.Parameter(torch.randn(96, 64, generator=generator), requires_grad=False)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.rows * scale, self.weight)


@pytest.mark.skipif(not torch._C.has_mkl, reason="inductor packs float32 for MKL only where torch has MKL")
@pytest.mark.parametrize("onednn", [False, True])
def test_onednn_float32_packs_static_products_of_several_rows_for_onednn(onednn):
    from torch._inductor.utils import run_and_get_code

    module = _StaticRows().eval()
    runner = CompiledRunner(module, "static rows")
    runner.onednn_rows = 2 if onednn else None
    scale = torch.tensor(0.5)
    with torch.inference_mode():  # as the engine calls it: inductor freezes (and packs) weights only there
        out, code = run_and_get_code(runner, scale)
    source = "\n".join(code)
    assert runner.failed is None
    assert ("mkldnn._linear_pointwise" in source) == onednn
    assert ("_mkl_linear" in source) == (not onednn)
    torch.testing.assert_close(out, module(scale), rtol=1e-5, atol=1e-5)


def test_onednn_float32_leaves_one_row_products_and_restores_inductors_choice():
    from torch._inductor.fx_passes import mkldnn_fusion

    from dspark.compiled import onednn_float32

    original = mkldnn_fusion.has_free_symbols
    with onednn_float32(2):
        assert mkldnn_fusion.has_free_symbols(8) and not mkldnn_fusion.has_free_symbols(1)
    with onednn_float32(None):
        assert mkldnn_fusion.has_free_symbols is original
    assert mkldnn_fusion.has_free_symbols is original and not original(8)
