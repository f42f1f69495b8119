"""Evaluation metrics, rollout recording, static threshold, Sequential Temperature Scaling and the
`dspark eval` / `dspark calibrate` commands, on hand-made rounds and tiny random models."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_GAMMA

from dspark.calibration import (
    calibration_arrays,
    fit_sequential_platt,
    fit_sequential_temperatures,
    position_reports,
    prefix_survival,
    sigmoid,
    store_calibration,
)
from dspark.cli import main
from dspark.drafters.base import Draft
from dspark.drafters.checkpoint import load_dspark, read_config
from dspark.errors import DrafterLoadError, DsparkError
from dspark.eval.evaluate import cut_at_threshold, domain_of
from dspark.eval.metrics import (
    acceptance_rate,
    accepted_length_histogram,
    conditional_acceptance,
    expected_calibration_error,
    expected_tau,
    roc_auc,
    tau,
)
from dspark.eval.rollout import RoundRecord, rollout_prompt
from dspark.generation import GenerationStats
from dspark.loading import load_target
from dspark.sampling import SamplingParams

# ------------------------------------------------------------------------------------ metrics

# (drafted, accepted) per round, hand-checked below
ROUNDS = [(4, 4), (4, 0), (4, 2), (2, 1), (0, 0)]
DRAFTED = [d for d, _ in ROUNDS]
ACCEPTED = [a for _, a in ROUNDS]


def test_tau_histogram_and_acceptance_rate():
    assert tau(ACCEPTED) == pytest.approx(1 + 7 / 5)
    assert tau([]) == 0.0
    assert accepted_length_histogram(ACCEPTED, 4) == [2, 1, 1, 0, 1]
    assert accepted_length_histogram(ACCEPTED) == [2, 1, 1, 0, 1]
    assert acceptance_rate(DRAFTED, ACCEPTED) == pytest.approx(7 / 14)
    assert acceptance_rate([0], [0]) is None


def test_conditional_acceptance_counts_only_reached_positions():
    positions = conditional_acceptance(DRAFTED, ACCEPTED)
    # k=1: rounds 1-4 reach it, 3 accept; k=2: rounds 1,3,4 reach it (1 accepted), 2 accept;
    # k=3: rounds 1,3 (2 accepted) reach it, round 1 accepts; k=4: only round 1.
    assert positions.attempts == [4, 3, 2, 1]
    assert positions.accepts == [3, 2, 1, 1]
    assert positions.rates == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1.0])
    stats = GenerationStats()  # the generation loop's own tally agrees
    for drafted, accepted in ROUNDS:
        stats.record_round(drafted, accepted)
    assert (stats.position_attempts, stats.position_accepts) == (positions.attempts, positions.accepts)
    with pytest.raises(ValueError):
        conditional_acceptance([2], [3])


def test_round_record_outcomes():
    record = RoundRecord(drafted=4, accepted=2, confidence=[0.5, 0.5, 0.5, 0.5])
    assert record.conditional_outcomes == [1, 1, 0]
    assert record.cumulative_outcomes == [1, 1, 0, 0]
    assert record.survival == pytest.approx([0.5, 0.25, 0.125, 0.0625])
    assert RoundRecord(3, 3).conditional_outcomes == [1, 1, 1]
    raw = RoundRecord(drafted=2, accepted=1, raw_logits=[0.0, math.log(3)])  # σ = 0.5, 0.75
    assert raw.raw_survival == pytest.approx([0.5, 0.375])
    assert RoundRecord(2, 1).raw_survival is None


@pytest.mark.parametrize("with_confidence", [False, True])
def test_expected_tau_needs_confidences(with_confidence):
    """Rounds that verified nothing count as predicting τ = 1 only for a drafter that has confidences."""
    from types import SimpleNamespace

    from dspark.eval.evaluate import summarise
    from dspark.eval.rollout import PromptRollout, RecordingDrafter

    confidence = torch.tensor([0.5, 0.5]) if with_confidence else None
    inner = SimpleNamespace(target_layer_ids=(), vocab_size=8, max_block_size=None,
                            propose=lambda *args: Draft(torch.tensor([1, 2]), None, confidence))
    stats = GenerationStats()
    recorder = RecordingDrafter(inner, stats)
    stats.record_round(0, 0)  # budget 0: propose never called
    recorder.propose(None, None, 2, None, None)
    stats.record_round(2, 2)
    rounds = recorder.records()
    summary = summarise([PromptRollout("x", rounds, stats)], 2)
    if with_confidence:
        assert [r.confidence for r in rounds] == [[], [0.5, 0.5]]
        assert summary["expected_tau"] == pytest.approx((1.0 + 1.75) / 2)
    else:
        assert [r.confidence for r in rounds] == [None, None]
        assert summary["expected_tau"] is None and summary["expected_tau_raw"] is None


def test_expected_tau_from_survival():
    # rounds: 1 + (0.5 + 0.25) and 1 + 0.9; an empty round (nothing drafted) expects only the bonus token
    assert expected_tau([[0.5, 0.25], [0.9], []]) == pytest.approx((1.75 + 1.9 + 1.0) / 3)
    assert expected_tau([]) is None
    # perfectly calibrated survival reproduces τ in expectation: a_k = c^k, accept k with prob c^k - c^(k+1)
    c, gamma = 0.6, 5
    rng = np.random.default_rng(0)
    accepted = [next((k for k in range(gamma) if rng.random() > c), gamma) for _ in range(20000)]
    survival = [c ** np.arange(1, gamma + 1) for _ in accepted]
    assert expected_tau(survival) == pytest.approx(tau(accepted), rel=0.02)


def test_expected_calibration_error_by_hand():
    probs, outcomes = [0.1, 0.2, 0.7, 0.8, 0.9, 1.0], [0, 1, 1, 1, 0, 1]
    # 2 bins: [0.1, 0.2] mean .15 vs .5 observed; [0.7..1.0] mean .85 vs .75 observed
    assert expected_calibration_error(probs, outcomes, 2) == pytest.approx((2 * 0.35 + 4 * 0.1) / 6)
    # 10 bins: 1.0 shares the last bin with 0.9 (mean .95 vs .5)
    assert expected_calibration_error(probs, outcomes, 10) == pytest.approx((0.1 + 0.8 + 0.3 + 0.2 + 2 * 0.45) / 6)
    assert expected_calibration_error([0.25, 0.25, 0.25, 0.25], [1, 0, 0, 0], 10) == pytest.approx(0.0)
    assert expected_calibration_error([], [], 10) == 0.0


def test_roc_auc_with_ties():
    # positive 0.4 vs negative 0.4 counts one half: (1 + 0.5 + 2) / 4
    assert roc_auc([0.1, 0.4, 0.4, 0.8], [0, 0, 1, 1]) == pytest.approx(0.875)
    assert roc_auc([0.1, 0.2, 0.3], [0, 1, 1]) == 1.0
    assert roc_auc([0.3, 0.2, 0.1], [0, 1, 1]) == 0.0
    assert roc_auc([0.5] * 4, [0, 1, 0, 1]) == 0.5
    assert roc_auc([0.1, 0.9], [1, 1]) is None


# ---------------------------------------------------------------------------- threshold wrapper


def test_cut_at_threshold():
    draft = Draft(torch.tensor([5, 6, 7, 8]), torch.full((4, 10), 0.1), torch.tensor([0.9, 0.8, 0.9, 0.5]))
    # a = 0.9, 0.72, 0.648, 0.324
    assert cut_at_threshold(draft, 0.7).tokens.tolist() == [5, 6]
    assert cut_at_threshold(draft, 0.7).q.shape == (2, 10)
    assert cut_at_threshold(draft, 0.3).tokens.tolist() == [5, 6, 7, 8]
    assert len(cut_at_threshold(draft, 0.95)) == 0
    with pytest.raises(DsparkError, match="confidence head"):
        cut_at_threshold(Draft(torch.tensor([1, 2])), 0.5)


def test_domains():
    assert [domain_of(n) for n in ("math500", "aime25", "gsm8k", "humaneval", "mbpp", "livecodebench",
                                   "mt-bench", "alpaca", "my-prompts")] == ["math"] * 3 + ["code"] * 3 + ["chat"] * 3


# ---------------------------------------------------------------------------------------- STS


def synthetic_rounds(num_rounds: int = 3000, gamma: int = 4, scale: float = 3.0, seed: int = 0) -> list[RoundRecord]:
    """Drafts survive with probability σ(z) given their prefix survived, but the head reports scale·z
    (overconfident, as the paper finds raw confidence heads)."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(num_rounds):
        z = rng.normal(1.0, 1.5, gamma)
        survived = rng.random(gamma) < sigmoid(z)
        accepted = gamma if survived.all() else int(np.argmin(survived))
        rounds.append(RoundRecord(gamma, accepted, raw_logits=(scale * z).tolist()))
    return rounds


def test_sts_lowers_ece_and_preserves_order():
    logits, outcomes = calibration_arrays(synthetic_rounds(), 4)
    temperatures = fit_sequential_temperatures(logits, outcomes)
    assert 2.0 < temperatures[0] < 4.5  # the true factor is 3
    reports = position_reports(logits, outcomes, temperatures)
    for report in reports:
        assert report.ece_after < report.ece_before
        assert report.ece_after < 0.03
    assert reports[0].ece_before > 0.05
    assert reports[0].auc_after == pytest.approx(reports[0].auc_before)  # a_1 = c_1: a monotone map
    for k, t in enumerate(temperatures):  # within one position, calibrated c_k rank exactly like z_k
        assert t > 0
        calibrated = sigmoid(logits[:, k] / t)
        assert (np.argsort(calibrated, kind="stable") == np.argsort(logits[:, k], kind="stable")).all()


def test_sts_leaves_calibrated_head_and_unseen_positions_alone():
    logits, outcomes = calibration_arrays(synthetic_rounds(scale=1.0), 4)
    temperatures = fit_sequential_temperatures(logits, np.where(np.arange(4) < 3, outcomes, np.nan))
    assert 0.7 < temperatures[0] < 1.4
    assert temperatures[3] == 1.0  # no rounds verified position 4
    assert fit_sequential_temperatures(logits[:20], outcomes[:20], min_rounds=50) == [1.0] * 4
    positives = np.nansum(outcomes, axis=0)
    fewest = int(positives.min())
    guarded = fit_sequential_temperatures(logits, outcomes, min_positives=fewest + 1)
    unguarded = fit_sequential_temperatures(logits, outcomes)
    for k in range(4):  # positions with too few accepted prefixes keep T = 1; the others are fitted as before
        expected = 1.0 if positives[k] < fewest + 1 else unguarded[k]
        assert guarded[k] == expected


def shifted_rounds(num_rounds: int = 6000, gamma: int = 4, seed: int = 1) -> list[RoundRecord]:
    """A head that is overconfident *and* off on average: drafts survive with σ(0.5·z - 1) given their
    prefix survived (temperature 2, bias -1), as a head trained on easier data than it serves."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(num_rounds):
        z = rng.normal(2.0, 2.0, gamma)
        survived = rng.random(gamma) < sigmoid(0.5 * z - 1.0)
        accepted = gamma if survived.all() else int(np.argmin(survived))
        rounds.append(RoundRecord(gamma, accepted, raw_logits=z.tolist()))
    return rounds


def test_platt_recovers_a_shifted_head_where_sts_cannot():
    logits, outcomes = calibration_arrays(shifted_rounds(), 4)
    temperatures, biases = fit_sequential_platt(logits, outcomes)
    assert temperatures[0] == pytest.approx(2.0, rel=0.15) and biases[0] == pytest.approx(-1.0, abs=0.15)
    observed = np.nanmean(outcomes, axis=0)  # what expected τ sums, position by position
    platt = np.nanmean(np.where(np.isnan(outcomes), np.nan, prefix_survival(logits, temperatures, biases)), axis=0)
    sts = np.nanmean(np.where(np.isnan(outcomes), np.nan,
                              prefix_survival(logits, fit_sequential_temperatures(logits, outcomes))), axis=0)
    assert np.abs(platt - observed).max() < 0.01
    assert np.abs(sts - observed).max() > 0.03  # the negative control: a temperature cannot move the mean
    platt_reports = position_reports(logits, outcomes, temperatures, biases=biases)
    for report, expected in zip(platt_reports, observed, strict=True):
        assert report.ece_after < report.ece_before and report.ece_after < 0.03
        assert report.mean_after == pytest.approx(expected, abs=0.01)
        assert report.auc_after == pytest.approx(report.auc_before, abs=0.02)
    for k, t in enumerate(temperatures):  # positive temperatures: each position's ranking is kept
        assert t > 0
        calibrated = sigmoid(logits[:, k] / t + biases[k])
        assert (np.argsort(calibrated, kind="stable") == np.argsort(logits[:, k], kind="stable")).all()


def test_platt_guards_thin_positions():
    logits, outcomes = calibration_arrays(shifted_rounds(num_rounds=400), 4)
    unseen = np.where(np.arange(4) < 3, outcomes, np.nan)
    temperatures, biases = fit_sequential_platt(logits, unseen)
    assert (temperatures[3], biases[3]) == (1.0, 0.0)  # no round verified position 4
    assert fit_sequential_platt(logits[:20], outcomes[:20], min_rounds=50) == ([1.0] * 4, [0.0] * 4)
    positives = np.nansum(outcomes, axis=0)
    guarded = fit_sequential_platt(logits, outcomes, min_positives=int(positives.min()) + 1)
    assert (guarded[0][-1], guarded[1][-1]) == (1.0, 0.0) and guarded[1][0] != 0.0


# ----------------------------------------------------------------------- tiny models on disk

GAMMA = TINY_GAMMA


@pytest.fixture(scope="module")
def tiny_dirs(tiny_on_disk):
    return tiny_on_disk


def copy_drafter(source, destination):
    destination.mkdir()
    for file in source.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


def test_temperatures_round_trip_and_change_confidence(tiny_dirs, tmp_path):
    path = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    target = load_target(str(tiny_dirs / "target")).model
    z = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    raw = load_dspark(path, target).model
    assert torch.allclose(raw.confidence(z), torch.sigmoid(z))

    temperatures = [2.0, 1.0, 0.5, 4.0]
    store_calibration(path, temperatures)
    assert read_config(path).calibration_temperatures == temperatures
    calibrated = load_dspark(path, target).model
    assert torch.allclose(calibrated.confidence(z), torch.sigmoid(z / torch.tensor(temperatures)))
    assert torch.allclose(calibrated.confidence(z[:, :2]), torch.sigmoid(z[:, :2] / torch.tensor([2.0, 1.0])))

    before = (path / "config.json").read_text()
    with pytest.raises(DrafterLoadError, match="calibration temperatures"):
        store_calibration(path, [1.0, 2.0])  # wrong length: refused, config untouched
    assert (path / "config.json").read_text() == before
    store_calibration(path, None)
    assert read_config(path).calibration_temperatures is None


def test_temperatures_per_sampling_temperature(tiny_dirs, tmp_path):
    """Sets fitted at different sampling temperatures live side by side; each request row takes the
    set fitted nearest its own temperature, and a refit replaces only the set at its temperature."""
    path = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    target = load_target(str(tiny_dirs / "target")).model
    greedy_set, sampled_set = [2.0, 1.0, 0.5, 4.0], [0.5, 3.0, 1.5, 0.8]
    (path / "config.json").chmod(0o644)
    store_calibration(path, sampled_set, 1.0)
    store_calibration(path, greedy_set, 0.0)
    assert (path / "config.json").stat().st_mode & 0o777 == 0o644  # readable by others, as before
    config = read_config(path)
    assert config.calibration_by_sampling == {0.0: greedy_set, 1.0: sampled_set}
    assert config.calibration_temperatures == greedy_set  # the fallback other loaders read: nearest greedy
    assert [config.temperatures_for(t) for t in (0.0, 0.4, 0.6, 1.0, 2.5)] == [
        greedy_set, greedy_set, sampled_set, sampled_set, sampled_set]

    model = load_dspark(path, target).model
    z = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    c = model.confidence(z, [0.0, 0.9])
    assert torch.allclose(c[0], torch.sigmoid(z[0] / torch.tensor(greedy_set)))
    assert torch.allclose(c[1], torch.sigmoid(z[1] / torch.tensor(sampled_set)))
    assert torch.allclose(model.confidence(z), torch.sigmoid(z / torch.tensor(greedy_set)))

    refit = [1.0, 1.0, 2.0, 2.0]
    store_calibration(path, refit, 1.0)
    assert read_config(path).calibration_by_sampling == {0.0: greedy_set, 1.0: refit}
    store_calibration(path, None)
    config = read_config(path)
    assert config.calibration_temperatures is None and config.calibration_by_sampling is None


def test_biases_round_trip_per_sampling_temperature(tiny_dirs, tmp_path):
    """Platt biases are stored next to the temperatures they were fitted with; a request takes both
    from the set fitted nearest its temperature; a temperature-only refit drops that set's biases and
    a temperature-only checkpoint carries no bias key (what other loaders see stays as it was)."""
    path = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    target = load_target(str(tiny_dirs / "target")).model
    greedy, greedy_b = [2.0, 1.0, 0.5, 4.0], [-1.0, 0.5, 0.0, 0.25]
    sampled, sampled_b = [0.5, 3.0, 1.5, 0.8], [0.3, -0.2, -1.5, 0.0]
    store_calibration(path, sampled, 1.0, sampled_b)
    store_calibration(path, greedy, 0.0, greedy_b)
    config = read_config(path)
    assert config.calibration_biases_by_sampling == {0.0: greedy_b, 1.0: sampled_b}
    assert config.calibration_biases == greedy_b and config.calibration_for(0.8) == (sampled, sampled_b)

    model = load_dspark(path, target).model
    z = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    c = model.confidence(z, [0.0, 1.0])
    assert torch.allclose(c[0], torch.sigmoid(z[0] / torch.tensor(greedy) + torch.tensor(greedy_b)))
    assert torch.allclose(c[1], torch.sigmoid(z[1] / torch.tensor(sampled) + torch.tensor(sampled_b)))
    assert torch.allclose(model.confidence(z[:1, :2]),
                          torch.sigmoid(z[:1, :2] / torch.tensor(greedy[:2]) + torch.tensor(greedy_b[:2])))

    store_calibration(path, sampled, 1.0)  # refit by STS: that set has no biases any more
    config = read_config(path)
    assert config.calibration_biases_by_sampling == {0.0: greedy_b} and config.calibration_for(1.0) == (sampled, None)
    assert torch.allclose(load_dspark(path, target).model.confidence(z, [1.0])[0],
                          torch.sigmoid(z[0] / torch.tensor(sampled)))
    store_calibration(path, greedy, 0.0)
    assert "calibration_biases" not in json.loads((path / "config.json").read_text())["dspark"]
    assert "calibration_biases_by_sampling" not in json.loads((path / "config.json").read_text())["dspark"]

    before = (path / "config.json").read_text()
    for bad in ([1.0, 2.0], [0.0, float("nan"), 0.0, 0.0]):
        with pytest.raises(DrafterLoadError, match="finite calibration biases"):
            store_calibration(path, greedy, 0.0, bad)
        assert (path / "config.json").read_text() == before
    data = json.loads(before)
    data["dspark"]["calibration_biases_by_sampling"] = {"2": [0.0] * GAMMA}  # no temperatures at T = 2
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(DrafterLoadError, match="have no temperatures"):
        read_config(path)


def test_bad_per_sampling_temperatures_are_refused(tiny_dirs, tmp_path):
    path = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    before = (path / "config.json").read_text()
    with pytest.raises(DrafterLoadError, match="need 4 positive calibration temperatures"):
        store_calibration(path, [1.0, 2.0], 1.0)  # wrong length: refused, config untouched
    assert (path / "config.json").read_text() == before
    data = json.loads(before)
    for bad in ({"x": [1.0] * GAMMA}, {"-1": [1.0] * GAMMA}, [[1.0] * GAMMA], {"0": [1.0, 0.0, 1.0, 1.0]}):
        data["dspark"]["calibration_by_sampling"] = bad
        (path / "config.json").write_text(json.dumps(data))
        with pytest.raises(DrafterLoadError):
            read_config(path)


def test_rollout_records_match_stats_and_raw_logits(tiny_dirs, tmp_path):
    from dspark.drafters import load_drafter
    from dspark.text import prompt_ids

    path = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    temperatures = [2.0, 0.5, 1.0, 3.0]
    store_calibration(path, [1.0, 1.0, 1.0, 1.0], 0.0)  # greedy requests only: not these sampled rounds
    store_calibration(path, temperatures, 1.0)
    loaded = load_target(str(tiny_dirs / "target"))
    drafter = load_drafter(str(path), loaded.model, draft_dtype=torch.float32)
    rollout = rollout_prompt(loaded, drafter, prompt_ids(loaded, "w1 w2 w3"), max_new_tokens=14,
                             sampling=SamplingParams(1.0), block_size=GAMMA, seed=3, dataset="x")
    stats = rollout.stats
    assert [r.drafted for r in rollout.rounds] == stats.drafted_per_round
    assert [r.accepted for r in rollout.rounds] == stats.accepted_per_round
    assert len(rollout.tokens) == stats.num_generated
    for record in rollout.rounds:
        assert len(record.confidence) == len(record.raw_logits) == record.drafted
        expected = [1 / (1 + math.exp(-z / t)) for z, t in zip(record.raw_logits, temperatures, strict=False)]
        assert record.confidence == pytest.approx(expected, rel=1e-5)
    assert "confidence" not in vars(drafter.model)  # the capture hook is removed afterwards


def run_cli(capsys, *argv) -> dict:
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def eval_args(dirs, *extra):
    return ["eval", "--target", dirs / "target", "--drafter", dirs / "drafter", "--dataset", dirs / "gsm8k.jsonl",
            "--dataset", dirs / "mbpp.jsonl", "--num-prompts", 3, "--max-new-tokens", 12, "--json", *extra]


def test_eval_end_to_end(tiny_dirs, tmp_path, capsys):
    report = run_cli(capsys, *eval_args(tiny_dirs, "--plot-dir", tmp_path / "plots"))
    assert set(report["datasets"]) == {"gsm8k", "mbpp"} and report["dtype"] == "float32"
    assert set(report["domains"]) == {"math", "code"}
    assert report["datasets"]["gsm8k"]["num_prompts"] == 3 and report["datasets"]["mbpp"]["num_prompts"] == 2
    rounds = report["num_rounds"]
    assert rounds == sum(d["num_rounds"] for d in report["datasets"].values())
    assert sum(report["accepted_length_histogram"]) == rounds
    accepted = sum(n * c for n, c in enumerate(report["accepted_length_histogram"]))
    assert report["tau"] == pytest.approx(1 + accepted / rounds, abs=1e-4)
    assert len(report["position_acceptance"]) == GAMMA == report["block_size"]
    assert 0 < report["tokens_verified_per_round"] <= GAMMA
    assert report["confidence"]["count"] > 0 and 0 <= report["confidence"]["ece"] <= 1
    # uncalibrated drafter: raw and calibrated expectations agree and stay within [1, 1 + γ]
    assert report["expected_tau"] == report["expected_tau_raw"]
    assert 1.0 <= report["expected_tau"] <= 1 + GAMMA
    assert report["time_s"]["draft"] > 0 and report["time_s"]["verify"] > 0
    for name in ("position_acceptance.png", "accepted_length_histogram.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_eval_threshold_cuts_drafts(tiny_dirs, capsys):
    full = run_cli(capsys, *eval_args(tiny_dirs))
    none_cut = run_cli(capsys, *eval_args(tiny_dirs, "--threshold", 0.0))
    assert none_cut["tau"] == full["tau"] and none_cut["num_rounds"] == full["num_rounds"]
    assert none_cut["tokens_verified_per_round"] == full["tokens_verified_per_round"]
    half = run_cli(capsys, *eval_args(tiny_dirs, "--threshold", 0.5))
    assert half["tokens_verified_per_round"] < full["tokens_verified_per_round"]
    everything_cut = run_cli(capsys, *eval_args(tiny_dirs, "--threshold", 1.0))
    assert everything_cut["tokens_verified_per_round"] == 0 and everything_cut["tau"] == 1.0


def test_calibrate_end_to_end(tiny_dirs, tmp_path, capsys):
    path = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    args = ["calibrate", "--target", tiny_dirs / "target", "--drafter", path, "--dataset",
            tiny_dirs / "mbpp.jsonl", "--num-prompts", 2, "--max-new-tokens", 16, "--temperature", 1,
            "--min-rounds", 1, "--min-positives", 0, "--json"]
    dry = run_cli(capsys, *args, "--dry-run")
    assert read_config(path).calibration_temperatures is None and dry["stored"] is False and dry["dtype"] == "float32"
    result = run_cli(capsys, *args, "--plot", tmp_path / "reliability.png")
    assert result["temperatures"] == dry["temperatures"]  # same seed, same rollouts
    assert len(result["temperatures"]) == GAMMA and len(result["positions"]) == GAMMA
    assert read_config(path).calibration_temperatures == pytest.approx(result["temperatures"], rel=1e-4)
    assert read_config(path).calibration_by_sampling[1.0] == pytest.approx(result["temperatures"], rel=1e-4)
    assert result["method"] == "platt" and len(result["biases"]) == GAMMA
    assert read_config(path).calibration_biases_by_sampling[1.0] == pytest.approx(result["biases"], abs=1e-4)
    first = result["positions"][0]
    assert first["count"] == result["num_rounds"] > 0
    assert first["mean_after"] == pytest.approx(first["mean_observed"], abs=0.05)  # a likelihood fit matches the mean
    assert (tmp_path / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    sts = run_cli(capsys, *args, "--method", "sts")
    assert sts["method"] == "sts" and sts["biases"] is None
    assert sts["positions"][0]["ece_after"] <= sts["positions"][0]["ece_before"] + 1e-9
    assert read_config(path).calibration_for(1.0) == (pytest.approx(sts["temperatures"], rel=1e-4), None)


@pytest.fixture
def tiny_corpus(tiny_dirs, tmp_path):
    """A corpus of 10 answers in the tiny target's vocabulary, as `dspark data pack` writes it (odd ones
    from source math, even ones from sharegpt)."""
    from test_corpus import SAMPLING, line, write_jsonl

    from dspark.train.corpus import corpus_from_jsonl, save_corpus

    vocab = load_target(str(tiny_dirs / "target")).model.config.vocab_size
    rng = torch.Generator().manual_seed(4)
    text = "".join(line(f"s{i}", [1, *torch.randint(3, vocab, (4 + i,), generator=rng).tolist()],
                        torch.randint(3, vocab, (6,), generator=rng).tolist(), source=("sharegpt", "math")[i % 2])
                   for i in range(10))
    corpus = corpus_from_jsonl([write_jsonl(tmp_path / "regen.jsonl", text)], target="tiny", target_revision="r",
                               vocab_size=vocab, sampling=SAMPLING)
    save_corpus(tmp_path / "corpus.safetensors", corpus)
    return corpus, tmp_path / "corpus.safetensors"


def test_eval_and_calibrate_roll_out_the_prompts_training_held_out(tiny_dirs, tiny_corpus, tmp_path, capsys,
                                                                   monkeypatch):
    """--corpus replays exactly the held-out split of `dspark train` (same fraction, seed, max_len), as token ids."""
    from dspark.eval import rollout
    from dspark.train import heldout
    from dspark.train.cached_data import heldout_samples

    corpus, path = tiny_corpus
    expected = heldout_samples(corpus, 1024, 0.5, 5)
    assert len(expected) >= 2
    seen = []
    real = rollout.rollout_prompt

    def recording(loaded, drafter, ids, **kwargs):
        seen.append(ids.tolist())
        return real(loaded, drafter, ids, **kwargs)

    monkeypatch.setattr(heldout, "rollout_prompt", recording)
    common = ["--target", tiny_dirs / "target", "--corpus", path, "--heldout-fraction", 0.5, "--split-seed", 5,
              "--num-prompts", 10, "--max-new-tokens", 8, "--json"]
    report = run_cli(capsys, "eval", "--drafter", tiny_dirs / "drafter", *common)
    assert seen == [corpus.prompt_ids(i).tolist() for i in expected]
    assert set(report["datasets"]) == {"heldout"}
    seen.clear()
    drafter = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    result = run_cli(capsys, "calibrate", "--drafter", drafter, *common, "--min-rounds", 1, "--dry-run")
    assert seen == [corpus.prompt_ids(i).tolist() for i in expected]
    assert result["num_prompts"] == len(expected) and result["num_rounds"] > 0 and result["corpus"] == str(path)
    assert main(["calibrate", "--target", str(tiny_dirs / "target"), "--drafter", str(drafter)]) == 2
    assert "--corpus" in capsys.readouterr().err
    seen.clear()  # --corpus-source: only the held-out prompts of that domain
    math = [i for i in expected if corpus.sources[corpus.source_index[i]] == "math"]
    assert 0 < len(math) < len(expected)
    run_cli(capsys, "calibrate", "--drafter", drafter, *common, "--min-rounds", 1, "--dry-run",
            "--corpus-source", "math")
    assert seen == [corpus.prompt_ids(i).tolist() for i in math]
    from dspark.train.heldout import of_sources

    chat = [i for i in expected if i not in math]
    mixed = of_sources(corpus, expected, ["math", "sharegpt"])  # in turn: balanced from the first prompt
    assert mixed[:2] == [math[0], chat[0]] and sorted(mixed) == sorted(expected)
    assert main(["calibrate", "--drafter", str(drafter), *map(str, common), "--corpus-source", "poetry"]) == 2
    assert "no source poetry" in capsys.readouterr().err


def test_calibrate_refuses_drafter_without_confidence_head(tiny_dirs, capsys):
    assert main(["calibrate", "--target", str(tiny_dirs / "target"), "--drafter", "ngram",
                 "--dataset", str(tiny_dirs / "mbpp.jsonl")]) == 2
    assert "nothing to calibrate" in capsys.readouterr().err


def test_replayed_sweeps_by_hand():
    from dspark.eval.evaluate import threshold_sweep, verify_length_sweep

    rounds = [RoundRecord(3, 3, [0.9, 0.8, 0.5]), RoundRecord(3, 0, [0.4, 0.9, 0.9]),
              RoundRecord(3, 1, [0.9, 0.5, 1.0])]
    sweep = verify_length_sweep(rounds, 3)
    assert [row["tau"] for row in sweep] == pytest.approx([1 + 2 / 3, 1 + 3 / 3, 1 + 4 / 3], abs=1e-4)
    assert sweep[0]["acceptance_rate"] == pytest.approx(2 / 3, abs=1e-4)
    cut = {row["threshold"]: row for row in threshold_sweep(rounds, thresholds=(0.0, 0.5))}
    # a = (0.9, 0.72, 0.36), (0.4, 0.36, 0.324), (0.9, 0.45, 0.45): at t = 0.5 the cuts are 2, 0, 1
    assert cut[0.5]["verified_per_round"] == pytest.approx(1.0)
    assert cut[0.5]["tokens_per_round"] == pytest.approx(1 + (2 + 0 + 1) / 3, abs=1e-4)
    assert cut[0.5]["acceptance_rate"] == pytest.approx(1.0)
    assert cut[0.0]["verified_per_round"] == pytest.approx(3.0)


def test_report_end_to_end(tiny_dirs, tmp_path, capsys):
    calibrated = copy_drafter(tiny_dirs / "drafter", tmp_path / "drafter")
    store_calibration(calibrated, [1.5, 1.0, 0.8, 2.0], biases=[0.25, -0.5, 0.0, 0.125])  # Platt: the biases too
    out = tmp_path / "docs" / "RESULTS.md"
    summary = run_cli(capsys, "report", "--target", tiny_dirs / "target", "--drafter", f"dspark={calibrated}",
                      "--drafter", "ngram=ngram", "--dataset", tiny_dirs / "gsm8k.jsonl", "--dataset",
                      tiny_dirs / "mbpp.jsonl", "--num-prompts", 2, "--max-new-tokens", 10, "--speed-prompts", 1,
                      "--depth", 1, "--block-sizes", "2,5", "--out", out)
    text = out.read_text()
    assert "Sequential Platt scaling, biases [0.25, -0.5, 0.0, 0.125]" in text
    for heading in ("Acceptance length", "Verify length", "Confidence threshold", "Calibration", "Batch-1 speed",
                    "Depth", "Expected τ predicted by the confidences"):
        assert heading in text
    assert set(summary["tau"]) == {"dspark@T=0", "dspark@T=1", "ngram@T=0", "ngram@T=1"}
    assert summary["dtype"] == "float32"
    names = {Path(p).name for p in summary["plots"]}
    assert {"position_acceptance.png", "verify_length.png", "threshold_sweep.png", "reliability.png",
            "block_size_latency.png"} <= names
    assert "| 5 |" in text.split("Block size γ")[1]  # one latency row per requested γ
    assert f"{summary['tau']['dspark@T=0']:.3f}" in text


@pytest.mark.parametrize("bad", ["4,x", "0,4"])
def test_report_rejects_bad_block_sizes(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--block-sizes", bad])
    assert exit_info.value.code == 2 and "block sizes" in capsys.readouterr().err


def test_speed_method_names():
    from dspark.bench import method_name

    assert method_name("dflash=runs/dflash/final") == ("ours_dflash", "runs/dflash/final")
    assert method_name("runs/dflash/final/") == ("ours_final", "runs/dflash/final/")
    assert method_name("/data/a=b/ckpt") == ("ours_ckpt", "/data/a=b/ckpt")  # '=' inside a path is not a name


def test_speed_bench_refuses_two_drafters_with_one_name(tiny_dirs, capsys):
    drafter = str(tiny_dirs / "drafter")
    assert main(["bench", "speed", "--target", str(tiny_dirs / "target"), "--dataset", str(tiny_dirs / "mbpp.jsonl"),
                 "--drafter", drafter, "--drafter", drafter]) == 2
    assert "both named" in capsys.readouterr().err


def test_report_render_names_the_target_and_derives_its_discussion_from_the_numbers():
    """docs/RESULTS.md is rendered from the run's JSON alone: the title is the run's target and the
    discussion's figures are this run's, so neither goes stale when the drafter changes."""
    from dspark.report import discussion, render

    acceptance = {"dspark@T=0": {"tau": 2.345, "position_acceptance": [0.61, 0.5], "datasets": {}, "domains": {},
                                 "acceptance_rate": 0.5, "draft_ms_per_round": 3.0, "verify_ms_per_round": 20.0}}
    data = {"command": "dspark report", "target": "Tiny-7M", "args": {"num_prompts": 1, "max_new_tokens": 8,
            "seed": 0, "datasets": []}, "acceptance": acceptance, "sweep_drafter": "dspark@T=0",
            "environment": {k: "x" for k in ("date", "commit", "cpu_count", "machine", "processor", "torch",
                                              "torch_threads", "transformers", "python")},
            "verify_length_sweep": [], "latency": {"verify": 20.0, "1": 2.0, "2": 5.0}}
    data["discussion"] = discussion(data)
    assert "τ 2.35" in data["discussion"] and "0.61" in data["discussion"] and "0.25×" in data["discussion"]
    page = render(data)
    assert page.startswith("# DSpark on Tiny-7M: results") and data["discussion"] in page
    assert "SmolLM2" not in page


def test_speed_bench_reports_identity_to_our_vanilla_decoding(tiny_on_disk, capsys, tmp_path, monkeypatch):
    """In float32 every one of our methods decodes exactly what our vanilla loop decodes (the scheduled one too,
    with its draft gate kept across prompts); nothing diverges."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "speed", "--target", str(tiny_on_disk / "target"), "--dataset",
                 str(tiny_on_disk / "mbpp.jsonl"), "--drafter", str(tiny_on_disk / "drafter"), "--num-prompts", "2",
                 "--max-new-tokens", "8", "--scheduler", "dspark", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["methods"]
    for name in ("ours_vanilla", "ours_ngram", "ours_drafter", "ours_drafter+dspark"):
        assert rows[name]["identical_to_ours_vanilla"] == 1.0 and rows[name]["divergence_gaps"] == []


def test_divergence_gap_is_the_top2_logit_gap_where_the_outputs_part():
    from conftest import tiny_model

    from dspark.bench import divergence_gap

    model = tiny_model("llama", num_layers=2)
    prompt = torch.tensor([3, 5, 7])
    reference = [9, 4, 6, 8]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[3, 5, 7, 9, 4]])).logits[0, -1]
    top = logits.topk(2).values
    assert divergence_gap(model, prompt, reference, [9, 4, 11, 8]) == pytest.approx(float(top[0] - top[1]), abs=1e-5)
    assert divergence_gap(model, prompt, reference, reference[:2]) is None  # a prefix: no token choice differs
