"""Paired bootstrap of two drafters' per-sample rollout-order sums (`dspark.eval.paired`)."""

import json

import pytest

from dspark.eval.paired import compare, main, paired_ratio


def sample(tokens: float, rounds: float, source: str = "math") -> dict:
    return {"source": source, "chain_tokens_greedy": tokens, "chain_rounds_greedy": rounds,
            "chain_tokens": tokens, "chain_rounds": rounds}


def test_identical_scores_read_one_with_no_spread():
    base = {f"s{i}": sample(10 + i, 4 + i % 3) for i in range(20)}
    row = paired_ratio(base, dict(base), "chain_tokens_greedy", "chain_rounds_greedy", resamples=200)
    assert row["ratio"] == pytest.approx(1.0) and row["ci95"] == pytest.approx([1.0, 1.0])
    assert row["p_other_ahead"] == 0.0 and row["samples"] == 20


def test_ratio_is_of_summed_tokens_over_rounds_on_common_samples():
    base = {"a": sample(10, 5), "b": sample(30, 10), "only_base": sample(99, 1)}
    other = {"a": sample(12, 5), "b": sample(30, 10), "only_other": sample(1, 99)}
    row = paired_ratio(base, other, "chain_tokens_greedy", "chain_rounds_greedy", resamples=500)
    assert row["samples"] == 2
    assert row["base_tau"] == pytest.approx(40 / 15) and row["other_tau"] == pytest.approx(42 / 15)
    assert row["ratio"] == pytest.approx(42 / 40)
    assert 1.0 <= row["ci95"][0] <= row["ratio"] <= row["ci95"][1]  # never behind on any sample
    with pytest.raises(ValueError, match="share no sample"):
        paired_ratio({"x": sample(1, 1)}, {"y": sample(1, 1)}, "chain_tokens_greedy", "chain_rounds_greedy")


def test_a_mixed_difference_gives_an_interval_around_one():
    base = {f"s{i}": sample(20, 10) for i in range(40)}
    other = {f"s{i}": sample(22 if i % 2 else 18, 10) for i in range(40)}  # equal in total, not per sample
    row = paired_ratio(base, other, "chain_tokens_greedy", "chain_rounds_greedy", resamples=2000, seed=1)
    assert row["ratio"] == pytest.approx(1.0)
    assert row["ci95"][0] < 0.99 and row["ci95"][1] > 1.01 and 0.2 < row["p_other_ahead"] < 0.8


def test_compare_splits_by_source_and_picks_the_temperature():
    base = {"m": sample(10, 5, "math"), "c": sample(10, 5, "code")}
    other = {"m": sample(15, 5, "math"), "c": sample(10, 5, "code")}
    other["c"]["chain_tokens"] = 20.0  # only the T = 1 sums differ on code
    greedy = compare({"samples": base}, {"samples": other}, 0.0, resamples=100)
    assert sorted(greedy) == ["all", "code", "math"]
    assert greedy["math"]["ratio"] == pytest.approx(1.5) and greedy["code"]["ratio"] == pytest.approx(1.0)
    sampled = compare({"samples": base}, {"samples": other}, 1.0, resamples=100)
    assert sampled["code"]["ratio"] == pytest.approx(2.0)


def test_cli_reads_score_files_and_rejects_old_ones(tmp_path, capsys):
    base, other, old = tmp_path / "base.json", tmp_path / "other.json", tmp_path / "old.json"
    base.write_text("progress\n" + json.dumps({"samples": {"a": sample(10, 5), "b": sample(8, 4)}}))
    other.write_text(json.dumps({"samples": {"a": sample(11, 5), "b": sample(9, 4)}}))
    old.write_text(json.dumps({"eval_tau": 2.0}))
    assert main([str(base), str(other), "--resamples", "50"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["all"]["ratio"] == pytest.approx(20 / 18)
    assert main([str(base), str(old)]) == 2
    assert "score the drafter again" in capsys.readouterr().err
    assert main([str(base), str(tmp_path / "missing.json")]) == 2
