"""Drafter training: loss terms, the soft confidence label, anchors, online features, config, and the
loop itself (exact resume after a kill, 2-process torchrun on CPU = single process)."""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file

from dspark.errors import DsparkError
from dspark.loading import load_target
from dspark.train.anchors import block_labels, candidate_anchors, sample_anchors, target_positions
from dspark.train.checkpointing import STATE_FILE, checkpoints
from dspark.train.cli_train import add_train_parser
from dspark.train.config import TrainConfig, load_config
from dspark.train.drafter_specs import DRAFTERS, grown_layers
from dspark.train.features import TargetFeatures
from dspark.train.losses import (
    LossWeights,
    acceptance_probability,
    block_loss,
    chained_rounds,
    expected_tau,
    position_weights,
)
from dspark.train.trainer import loss_weights, train
from dspark.verify import verify_sampled

REPO = Path(__file__).resolve().parents[1]

# -- losses ----------------------------------------------------------------------------------------


def test_position_weights():
    w = position_weights(3, decay=4.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    assert torch.equal(position_weights(3, decay=0), torch.ones(3))


def test_loss_terms_by_hand():
    # one block of γ = 2 over a 2-token vocabulary; the second position is masked for one variant
    q0, q1 = [0.5, 0.5], [0.8, 0.2]
    p0, p1 = [0.9, 0.1], [0.8, 0.2]
    logits = torch.tensor([q0, q1]).log()[None]
    target_logits = torch.tensor([p0, p1]).log()[None]
    labels = torch.tensor([[0, 1]])
    confidence_logits = torch.tensor([[0.0, 2.0]])
    decay = 4.0
    w = [1.0, math.exp(-1 / decay)]
    ce = [-math.log(0.5), -math.log(0.2)]
    l1 = [abs(0.5 - 0.9) + abs(0.5 - 0.1), 0.0]  # ‖q − p‖₁
    label = [1 - 0.5 * x for x in l1]  # c* = 1 − ½‖q − p‖₁: 0.6 and 1.0
    c = [0.5, 1 / (1 + math.exp(-2.0))]
    bce = [-(y * math.log(ci) + (1 - y) * math.log(1 - ci)) for y, ci in zip(label, c, strict=True)]

    def mean(values, mask):
        return sum(wi * v * m for wi, v, m in zip(w, values, mask, strict=True)) / sum(
            wi * m for wi, m in zip(w, mask, strict=True))

    for mask in ([1, 1], [1, 0]):
        valid = torch.tensor([mask], dtype=torch.bool)
        out = block_loss(logits, target_logits, labels, valid, confidence_logits, LossWeights(0.1, 0.9, 1.0), decay)
        expected = [mean(ce, mask), mean(l1, mask), mean(bce, mask)]
        assert out.ce.item() == pytest.approx(expected[0], rel=1e-5)
        assert out.tv.item() == pytest.approx(expected[1], rel=1e-5, abs=1e-6)
        assert out.conf.item() == pytest.approx(expected[2], rel=1e-5)
        total = 0.1 * expected[0] + 0.9 * expected[1] + 1.0 * expected[2]
        assert out.total.item() == pytest.approx(total, rel=1e-5)
        assert out.accept.item() == pytest.approx(mean(label, mask), rel=1e-5)
        assert torch.allclose(out.soft_label, torch.tensor([label]))

    # DFlash: CE only; the soft label carries no gradient into the drafter through the BCE target
    out = block_loss(logits, target_logits, labels, torch.ones(1, 2, dtype=torch.bool), None, LossWeights(1, 0, 0))
    assert out.total.item() == pytest.approx(mean(ce, [1, 1]), rel=1e-5)
    assert out.conf.item() == 0.0


def test_soft_label_is_detached():
    logits = torch.randn(1, 3, 7, requires_grad=True)
    confidence_logits = torch.randn(1, 3, requires_grad=True)
    out = block_loss(logits, torch.randn(1, 3, 7), torch.zeros(1, 3, dtype=torch.long),
                     torch.ones(1, 3, dtype=torch.bool), confidence_logits, LossWeights(0.0, 0.0, 1.0))
    out.total.backward()
    assert logits.grad is None or torch.count_nonzero(logits.grad) == 0
    assert confidence_logits.grad is not None and torch.count_nonzero(confidence_logits.grad) > 0


def test_soft_label_equals_rejection_sampling_acceptance():
    """c* = 1 − ½‖q − p‖₁ is the probability that verify_sampled accepts x ~ q. Monte Carlo with n draws:
    the standard error is <= 0.5/sqrt(n) = 0.0035; we allow 5 of them (false-failure prob ~ 6e-7)."""
    generator = torch.Generator().manual_seed(0)
    vocab, n = 6, 20000
    for trial in range(2):
        q = torch.rand(vocab, generator=generator) ** 3
        q /= q.sum()
        p = torch.rand(vocab, generator=generator)
        p /= p.sum()
        c_star = block_loss(q.log()[None, None], p.log()[None, None], torch.zeros(1, 1, dtype=torch.long),
                            torch.ones(1, 1, dtype=torch.bool)).soft_label.item()
        assert c_star == pytest.approx(torch.minimum(p, q).sum().item(), abs=1e-6)
        assert c_star == pytest.approx(acceptance_probability(q, p).item(), abs=1e-6)
        drafts = torch.multinomial(q, n, replacement=True, generator=generator)
        p_rows = torch.stack([p, p])
        accepted = sum(verify_sampled(x[None], q[None], p_rows, generator).num_accepted for x in drafts)
        assert accepted / n == pytest.approx(c_star, abs=5 * 0.5 / math.sqrt(n)), trial


def test_expected_tau():
    tv = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [1.0, 0.0, 0.0]])
    # 1 + 1 + 1 + 1 = 4; 1 + .5 + .25 + .125; 1 + 0
    assert expected_tau(tv).item() == pytest.approx((4 + 1.875 + 1) / 3)
    valid = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    assert expected_tau(tv, valid).item() == pytest.approx((3 + 1.875) / 2)


def answer_accept(probabilities: torch.Tensor, gamma: int) -> torch.Tensor:
    """(A, γ) acceptance of the drafts from every anchor of an answer with A + 1 tokens, draft k at anchor a
    accepted with probabilities[a + k - 1] (a position's difficulty) and never past the answer's end."""
    num_anchors = len(probabilities) - 1
    accept = torch.zeros(num_anchors, gamma, dtype=torch.float64)
    for a in range(num_anchors):
        for k in range(min(gamma, num_anchors - a)):
            accept[a, k] = probabilities[a + k + 1]
    return accept


def test_chained_rounds_follows_a_greedy_rollout():
    """At T = 0 the chain is the rollout: all drafts right -> rounds of γ + 1 tokens; all wrong -> one token a
    round; an easy stretch is crossed in few rounds, so its tokens per round fall below the all-anchor mean."""
    tokens, rounds = chained_rounds(answer_accept(torch.ones(17), gamma=7))
    assert (tokens, rounds) == (16.0, 2.0)  # anchors 0 and 8, each committing 7 drafts + the bonus
    tokens, rounds = chained_rounds(answer_accept(torch.zeros(17), gamma=7))
    assert (tokens, rounds) == (16.0, 16.0)
    difficulty = torch.tensor([1.0] * 9 + [0.0] * 8)  # easy first half, then every draft wrong
    accept = answer_accept(difficulty, gamma=7)
    tokens, rounds = chained_rounds(accept)
    assert (tokens, rounds) == (16.0, 9.0)  # one round of 8 over the easy half, then one token a round
    all_anchor_mean = (1 + accept.cumprod(-1).sum(-1)).mean().item()
    assert tokens / rounds < all_anchor_mean


def test_chained_rounds_is_the_expected_sampled_rollout():
    """At T = 1 (acceptance probabilities) tokens / rounds is the ratio of a simulated rollout's totals."""
    generator = torch.Generator().manual_seed(0)
    accept = answer_accept(torch.rand(41, generator=generator), gamma=4)
    tokens, rounds = chained_rounds(accept)
    rng = np.random.default_rng(0)
    total_tokens = total_rounds = 0
    for _ in range(4000):
        a = 0
        while a < len(accept):
            accepted = 0
            while accepted < 4 and rng.random() < accept[a, accepted]:
                accepted += 1
            total_tokens, total_rounds, a = total_tokens + accepted + 1, total_rounds + 1, a + accepted + 1
    assert tokens / rounds == pytest.approx(total_tokens / total_rounds, rel=0.01)
    assert tokens == pytest.approx(total_tokens / 4000, rel=0.01)


# -- anchors ---------------------------------------------------------------------------------------


def test_anchors_stay_inside_answers():
    generator = torch.Generator().manual_seed(1)
    gamma = 5
    for _ in range(50):
        length = int(torch.randint(5, 40, (1,), generator=generator))
        answer = torch.zeros(length, dtype=torch.bool)  # a multi-turn layout: two answer spans, a gap
        a0 = int(torch.randint(1, length, (1,), generator=generator))
        a1 = int(torch.randint(a0, length + 1, (1,), generator=generator))
        answer[a0:a1] = True
        b0 = min(a1 + int(torch.randint(1, 4, (1,), generator=generator)), length)
        answer[b0 : b0 + int(torch.randint(0, 10, (1,), generator=generator))] = True
        ids = torch.randint(3, 90, (1, length), generator=generator)
        anchors, keep = sample_anchors(answer, 6, generator)
        assert keep.sum() == min(6, candidate_anchors(answer).numel())
        real = anchors[keep]
        assert torch.equal(real, real.sort().values) and real.unique().numel() == real.numel()
        assert answer[real].all() and answer[real + 1].all()
        labels, valid = block_labels(ids, answer[None], anchors[None], keep[None], gamma)
        positions = anchors[None, :, None] + torch.arange(1, gamma + 1)
        assert torch.equal(labels[valid], ids[0][positions[valid]])
        assert (positions[valid] < length).all() and answer[positions[valid]].all()  # labels = answer tokens
        assert torch.equal(valid, valid.long().cumprod(-1).bool())  # a contiguous prefix of the block
        assert not valid[0][~keep].any()
        assert valid[0][keep][:, 0].all()  # every real anchor supervises at least x_{a+1}
        # the first invalid label of a block is a non-answer position or past the end
        for row, pos in zip(valid[0][keep], positions[0][keep], strict=True):
            if not row.all():
                first = pos[~row][0]
                assert first >= length or not answer[first]
        assert (target_positions(anchors[None], gamma, length) < length).all()


def test_anchor_sampling_is_deterministic():
    answer = torch.zeros(64, dtype=torch.bool)
    answer[10:60] = True
    first = sample_anchors(answer, 8, torch.Generator().manual_seed(3))
    again = sample_anchors(answer, 8, torch.Generator().manual_seed(3))
    other = sample_anchors(answer, 8, torch.Generator().manual_seed(4))
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], other[0])


# -- online features -------------------------------------------------------------------------------


def test_target_features_match_the_full_forward():
    model = tiny_model("llama", num_layers=4).requires_grad_(False)
    layer_ids = (-1, 1, 2)
    features = TargetFeatures(model, layer_ids)
    ids = torch.randint(3, 90, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    positions = torch.tensor([[[0, 1], [5, 6]], [[2, 3], [6, 7]]])
    feats, logits = features(ids, mask, positions)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    expected = torch.cat([full.hidden_states[i + 1] for i in layer_ids], -1)
    assert feats.shape == (2, 12, 3 * 64) and torch.allclose(feats, expected, atol=1e-6)
    for b in range(2):
        assert torch.allclose(logits[b], full.logits[b][positions[b]], atol=1e-5)
    with torch.no_grad():  # right padding does not change the valid positions
        alone = model(input_ids=ids[1:, :8], output_hidden_states=True, use_cache=False)
    assert torch.allclose(feats[1, :8], torch.cat([alone.hidden_states[i + 1][0] for i in layer_ids], -1),
                          atol=1e-5)


@pytest.mark.parametrize("drafter_type", ["eagle3", "mtp"])
def test_baseline_blocks_match_their_training_forward(drafter_type):
    """The trainer's EAGLE-3/MTP adapters compute the LM head only at the anchor rows; same numbers as the
    drafters' own training forward."""
    target = tiny_model("llama", num_layers=4).requires_grad_(False)
    config = TrainConfig(drafter_type=drafter_type, block_size=3, num_draft_layers=2)
    spec = DRAFTERS[drafter_type]
    torch.manual_seed(0)
    drafter = spec.build(config, target).float()
    ids = torch.randint(3, 90, (2, 14))
    feats, _ = TargetFeatures(target, tuple(drafter.config.target_layer_ids))(ids, torch.ones_like(ids))
    anchors = torch.tensor([[1, 4, 9], [2, 3, 10]])
    logits, confidence = spec.blocks(drafter, feats, ids, anchors)
    full = drafter(feats, ids, 3)
    assert confidence is None and logits.shape == (2, 3, 3, 96)
    for b in range(2):
        for j in range(3):
            assert torch.allclose(logits[b, :, j], full[j][b, anchors[b] - 1], atol=1e-5)


# -- config ----------------------------------------------------------------------------------------


def test_config_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("drafter_type: dflash\nlr: 3e-4\nmax_steps: 10\ntarget_layer_ids: [1, 2]\n")
    config = load_config(path, ["max_steps=20", "tensorboard=false", "ce_weight=0.5", "mask_token_id=none",
                                "target_layer_ids=3,4"])
    assert config.drafter_type == "dflash" and config.lr == 3e-4 and config.max_steps == 20
    assert config.tensorboard is False and config.ce_weight == 0.5 and config.mask_token_id is None
    assert config.target_layer_ids == [3, 4]
    assert load_config(path, drafter_type="mtp").drafter_type == "mtp"


def test_unknown_or_bad_config_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.1\n")
    with pytest.raises(DsparkError, match="unknown key.*learning_rate"):
        load_config(path)
    with pytest.raises(DsparkError, match="unknown key.*bogus"):
        load_config(None, ["bogus=1"])
    with pytest.raises(DsparkError, match="max_steps"):
        load_config(None, ["max_steps=many"])
    with pytest.raises(DsparkError, match="drafter_type"):
        load_config(None, ["drafter_type=medusa"])
    with pytest.raises(DsparkError, match="key=value"):
        load_config(None, ["lr"])
    with pytest.raises(DsparkError, match="autocast"):
        load_config(None, ["autocast=fp8"])


def test_cli_parser_registers_train():
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--config", "x.yaml", "--resume", "--drafter-type", "dflash", "lr=1e-3"])
    assert args.resume == "latest" and args.drafter_type == "dflash" and args.overrides == ["lr=1e-3"]
    assert callable(args.handler)


@pytest.mark.parametrize("name", ["smollm2-dspark.yaml", "smollm2-dflash.yaml"])
def test_shipped_configs_load(name):
    config = load_config(REPO / "configs" / name)
    assert config.drafter_type == name.split("-")[1].removesuffix(".yaml")


@pytest.mark.parametrize("drafter_type, expected", [("dspark", (0.1, 0.9, 1.0)), ("dflash", (1.0, 0.0, 0.0)),
                                                     ("eagle3", (1.0, 0.0, 0.0)), ("mtp", (1.0, 0.0, 0.0))])
def test_drafter_type_override_gets_its_own_loss(drafter_type, expected):
    """`--config smollm2-dspark.yaml --drafter-type eagle3` must not train a baseline on DSpark's loss."""
    config = load_config(REPO / "configs" / "smollm2-dspark.yaml", [], drafter_type=drafter_type)
    weights = loss_weights(config)
    assert (weights.ce, weights.tv, weights.conf) == pytest.approx(expected)
    overridden = load_config(REPO / "configs" / "smollm2-dspark.yaml", ["ce_weight=1.0"], drafter_type=drafter_type)
    assert loss_weights(overridden).ce == 1.0


# -- the loop --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny random Llama target on disk and pre-tokenised synthetic conversations (answers follow a
    simple arithmetic pattern, so a drafter has something to learn)."""
    root = tmp_path_factory.mktemp("train")
    tiny_model("llama", num_layers=4).save_pretrained(root / "target")
    generator = torch.Generator().manual_seed(0)
    with (root / "data.jsonl").open("w") as f:
        for _ in range(24):
            prompt = torch.randint(3, 90, (int(torch.randint(4, 12, (1,), generator=generator)),), generator=generator)
            start = int(torch.randint(3, 90, (1,), generator=generator))
            answer = [(start + 3 * k) % 87 + 3 for k in range(int(torch.randint(8, 30, (1,), generator=generator)))]
            f.write(json.dumps({"prompt_ids": prompt.tolist(), "answer_ids": answer + [2]}) + "\n")
    return root


def tiny_config(workdir: Path, out: str, **fields) -> TrainConfig:
    values = dict(target=str(workdir / "target"), data=str(workdir / "data.jsonl"), seq_len=40, batch_size=4,
                  anchors_per_seq=4, block_size=4, markov_rank=8, max_steps=6, warmup_steps=2, save_every=3,
                  eval_every=3, heldout_fraction=0.2, progress=False, threads=1, keep_checkpoints=0,
                  output_dir=str(workdir / out))
    values.update(fields)
    return TrainConfig(**values)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Killed(Exception):
    pass


def test_kill_and_resume_gives_the_same_weights(workdir):
    full = tiny_config(workdir, "full")
    train(full)
    reference = load_file(str(workdir / "full" / "final" / "model.safetensors"))

    interrupted = tiny_config(workdir, "interrupted")

    def kill(step, metrics):
        if step == 4:  # one step past the checkpoint at step 3: that step is lost and redone
            raise Killed

    with pytest.raises(Killed):
        train(interrupted, on_step=kill)
    assert [p.name for p in checkpoints(workdir / "interrupted")] == ["checkpoint-0000003"]
    state = torch.load(workdir / "interrupted" / "checkpoint-0000003" / STATE_FILE, weights_only=True)
    assert state["step"] == 3
    half_written = workdir / "interrupted" / ".tmp-checkpoint-0000005"  # a checkpoint write cut by a kill
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"junk")
    train(interrupted, resume="latest")
    resumed = load_file(str(workdir / "interrupted" / "final" / "model.safetensors"))
    assert reference.keys() == resumed.keys()
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), key
    full_log = [r for r in read_log(workdir / "full" / "train_log.jsonl") if "loss" in r]
    resumed_log = [r for r in read_log(workdir / "interrupted" / "train_log.jsonl") if "loss" in r]
    assert [r["step"] for r in resumed_log] == list(range(1, 7))  # steps logged after the checkpoint are redone
    assert [r["loss"] for r in full_log] == [r["loss"] for r in resumed_log]


@pytest.mark.parametrize("drafter_type", ["dflash", "eagle3", "mtp"])
def test_baselines_train_with_ce_only(workdir, drafter_type):
    out = workdir / drafter_type
    result = train(tiny_config(workdir, drafter_type, drafter_type=drafter_type, max_steps=2, save_every=2,
                               eval_every=2, num_draft_layers=1))
    assert result["loss"] == pytest.approx(result["ce"]) and result["conf"] == 0.0
    assert result["eval_tau"] >= 1.0
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["dspark"]["drafter_type"] == drafter_type
    if drafter_type == "dflash":
        assert config["markov_head_type"] is None and not config["enable_confidence_head"]


def test_bf16_autocast_tracks_fp32_training(workdir):
    """The drafter forward under bf16 autocast (loss in fp32) follows the fp32 run closely."""
    fp32 = train(tiny_config(workdir, "fp32", max_steps=3, save_every=3, eval_every=3))
    bf16 = train(tiny_config(workdir, "bf16", max_steps=3, save_every=3, eval_every=3, autocast="bfloat16"))
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05)
    assert bf16["loss"] != fp32["loss"]  # autocast really ran


def run_torchrun(command: list[str], env: dict, output_dir: Path, attempts: int = 2,
                 timeout: int = 240) -> subprocess.CompletedProcess:
    """torchrun, retried once from scratch when it hangs: gloo's teardown has been seen to hang once in a
    full CI run on a loaded machine (pytorch/pytorch#75097) and never in isolation; a second hang fails."""
    hang = None
    for _ in range(attempts):
        shutil.rmtree(output_dir, ignore_errors=True)
        try:
            return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            hang = error
    raise AssertionError(f"torchrun hung {attempts} times; stderr: {hang.stderr!r}") from hang


def test_torchrun_two_processes_match_single_process(workdir):
    single = tiny_config(workdir, "single", max_steps=4, save_every=4, eval_every=4)
    train(single)
    script = workdir / "train_cli.py"  # `dspark train` through its own parser
    script.write_text("import argparse, sys\n"
                      "from dspark.train.cli_train import add_train_parser\n"
                      "parser = argparse.ArgumentParser()\n"
                      "add_train_parser(parser.add_subparsers())\n"
                      "args = parser.parse_args(sys.argv[1:])\n"
                      "args.handler(args)\n")
    ddp = tiny_config(workdir, "ddp", max_steps=4, save_every=4, eval_every=4)
    overrides = [f"{k}={v}" for k, v in ddp.to_dict().items() if v is not None]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), "train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = run_torchrun(command, env, workdir / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    single_log = read_log(workdir / "single" / "train_log.jsonl")
    ddp_log = read_log(workdir / "ddp" / "train_log.jsonl")
    train_single = [r for r in single_log if "loss" in r]
    train_ddp = [r for r in ddp_log if "loss" in r]
    assert len(train_single) == len(train_ddp) == 4
    for a, b in zip(train_single, train_ddp, strict=True):
        assert a["tokens"] == b["tokens"] and a["supervised"] == b["supervised"]
        for key in ("loss", "ce", "tv", "conf", "tau"):
            assert b[key] == pytest.approx(a[key], rel=1e-3), (a["step"], key)
    eval_single = [r for r in single_log if "eval_tau" in r][-1]
    eval_ddp = [r for r in ddp_log if "eval_tau" in r][-1]
    assert eval_ddp["eval_tau"] == pytest.approx(eval_single["eval_tau"], rel=1e-3)
    a = load_file(str(workdir / "single" / "final" / "model.safetensors"))
    b = load_file(str(workdir / "ddp" / "final" / "model.safetensors"))
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-3), key


def test_loss_decreases_on_a_learnable_pattern(workdir):
    config = tiny_config(workdir, "learn", max_steps=30, save_every=30, eval_every=30, lr=3e-3, anchors_per_seq=8,
                         warmup_steps=3)
    train(config)
    log = [r for r in read_log(workdir / "learn" / "train_log.jsonl") if "loss" in r]
    first = sum(r["ce"] for r in log[:3]) / 3
    last = sum(r["ce"] for r in log[-3:]) / 3
    assert last < 0.8 * first


def test_init_from_checkpoint_continues_from_its_weights(workdir):
    first = tiny_config(workdir, "first", max_steps=3, save_every=3, eval_every=3)
    train(first)
    source = workdir / "first" / "final"
    built = DRAFTERS["dspark"].build(tiny_config(workdir, "x", init_from=str(source)),
                                     load_target(str(workdir / "target")).model)
    saved = load_file(str(source / "model.safetensors"))
    assert torch.equal(built.fc.weight, saved["fc.weight"].float())
    with pytest.raises(DsparkError, match="does not match"):
        DRAFTERS["dspark"].build(tiny_config(workdir, "y", init_from=str(source), markov_rank=4),
                                 load_target(str(workdir / "target")).model)
    with pytest.raises(DsparkError, match="init_from"):
        DRAFTERS["dspark"].build(tiny_config(workdir, "z", init_from=str(workdir / "missing")),
                                 load_target(str(workdir / "target")).model)
    # gaining the last-context input keeps every trained weight and starts the new projection at zero
    fused = DRAFTERS["dspark"].build(tiny_config(workdir, "w", init_from=str(source), last_context_input=True),
                                     load_target(str(workdir / "target")).model)
    assert torch.equal(fused.fc.weight, saved["fc.weight"].float())
    assert fused.last_context_proj is not None and not fused.last_context_proj.weight.any()


def test_init_from_a_shallower_checkpoint_grows_layers_that_start_as_the_identity(workdir):
    """A 2-layer drafter grown from a trained 1-layer one computes exactly the trained drafter's blocks (the new
    layer's residual outputs are zero) yet can learn: its other weights are the trained top layer's."""
    train(tiny_config(workdir, "shallow", max_steps=3, save_every=3, eval_every=3))
    source = str(workdir / "shallow" / "final")
    target = load_target(str(workdir / "target")).model
    shallow = DRAFTERS["dspark"].build(tiny_config(workdir, "a", init_from=source), target)
    deep = DRAFTERS["dspark"].build(tiny_config(workdir, "b", init_from=source, num_draft_layers=2), target)
    assert len(shallow.layers) == 1 and len(deep.layers) == 2
    new, top = deep.layers[1], shallow.layers[0]
    assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
    assert torch.equal(new.self_attn.q_proj.weight, top.self_attn.q_proj.weight)
    assert torch.equal(new.mlp.gate_proj.weight, top.mlp.gate_proj.weight)
    ids = torch.randint(3, 90, (2, 20))
    feats, _ = TargetFeatures(target, tuple(shallow.config.target_layer_ids))(ids, torch.ones_like(ids))
    anchors = torch.tensor([[2, 7, 11, 15], [1, 5, 9, 14]])
    with torch.no_grad():
        logits, confidence = DRAFTERS["dspark"].blocks(shallow, feats, ids, anchors)
        grown_logits, grown_confidence = DRAFTERS["dspark"].blocks(deep, feats, ids, anchors)
    assert torch.allclose(grown_logits, logits, atol=1e-6) and torch.allclose(grown_confidence, confidence, atol=1e-6)
    DRAFTERS["dspark"].save(deep, workdir / "deep", torch.float32)
    with pytest.raises(DsparkError, match="does not match"):  # fewer layers than the checkpoint: refused
        DRAFTERS["dspark"].build(tiny_config(workdir, "c", init_from=str(workdir / "deep")), target)
    grown_state = grown_layers({"layers.0.mlp.down_proj.weight": torch.ones(2, 2)}, 3)
    assert sorted(grown_state) == [f"layers.{i}.mlp.down_proj.weight" for i in range(3)]
    assert grown_layers(grown_state, 2) is grown_state  # never shrinks


def test_init_from_target_copies_the_last_layer(workdir):
    target = load_target(str(workdir / "target")).model
    drafter = DRAFTERS["dspark"].build(tiny_config(workdir, "x", init_from_target=True), target)
    last = target.model.layers[-1]
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
    hidden = target.config.hidden_size
    assert torch.equal(drafter.fc.weight[:, -hidden:], torch.eye(hidden))  # deepest feature layer passes through
    assert not drafter.fc.weight[:, :-hidden].any()
