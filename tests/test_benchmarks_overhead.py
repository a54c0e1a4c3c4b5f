"""benchmarks/overhead.py's helpers for the vLLM variant: the lower quartile, the bootstrap interval of a ratio of
pooled medians (or quartiles), and the per-step profile (step times, policy forwards by grad mode, phase seconds)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.overhead import StepProfile, bootstrap_ratio, lower_quartile


def test_constant_runs_give_the_exact_ratio():
    assert bootstrap_ratio([[2.0] * 5, [2.0] * 3], [[1.0] * 4]) == (2.0, 2.0)


def test_resamples_stay_within_each_run():
    # Two runs of five: every stratified resample holds five 1.0s and five 3.0s, so the pooled median is 2.0 each
    # time. Resampling the pool as one (ignoring runs) gives a median of 1.0 or 3.0 in 75% of resamples.
    assert bootstrap_ratio([[1.0] * 5, [3.0] * 5], [[1.0] * 3]) == (2.0, 2.0)


def test_interval_bounds_are_the_quantiles_of_the_resampled_ratios():
    # The median of three draws from {1, 2, 3}: 1 with probability 7/27 (two or three 1s: 3*(1/3)^2*(2/3) + (1/3)^3),
    # 3 likewise, 2 otherwise (13/27). 95%: quantiles 0.025 and 0.975 -> (1, 3); 40%: quantiles 0.3 and 0.7 both
    # fall in the middle value's 0.259 - 0.741 -> (2, 2).
    runs = [[1.0, 2.0, 3.0]]
    assert bootstrap_ratio(runs, [[1.0]], resamples=4000) == (1.0, 3.0)
    assert bootstrap_ratio(runs, [[1.0]], resamples=4000, level=0.4) == (2.0, 2.0)
    # the denominator's spread enters inverted
    assert bootstrap_ratio([[1.0]], runs, resamples=4000) == (1 / 3, 1.0)
    # same seed, same interval
    assert bootstrap_ratio(runs, [[1.5, 2.5]], seed=7) == bootstrap_ratio(runs, [[1.5, 2.5]], seed=7)


def test_lower_quartile_interpolates_at_a_quarter_of_the_sorted_positions():
    assert lower_quartile([5.0, 1.0, 4.0, 2.0, 3.0]) == 2.0  # position 1 of 1..5
    assert lower_quartile([4.0, 1.0, 3.0, 2.0]) == 1.75  # position 0.75: 1 + 0.75 * (2 - 1)
    assert lower_quartile([7.0]) == 7.0
    with pytest.raises(ValueError, match="at least one value"):
        lower_quartile([])


def test_bootstrap_of_the_lower_quartile():
    # Every resample of a run of constant values is that run: the ratio of lower quartiles is exact.
    num, den = [[1.0] * 4, [5.0] * 4], [[2.0] * 8]
    # pooled num: four 1.0s then four 5.0s; position 0.25 * 7 = 1.75 lies among the 1.0s -> 1.0 / 2.0
    assert bootstrap_ratio(num, den, stat=lower_quartile) == (0.5, 0.5)


@pytest.mark.parametrize("num, den", [([], [[1.0]]), ([[1.0]], []), ([[1.0], []], [[1.0]])])
def test_empty_runs_are_refused(num, den):
    with pytest.raises(ValueError, match="at least one run"):
        bootstrap_ratio(num, den)


def test_step_profile_counts_forwards_by_grad_mode_and_times_phases():
    model = torch.nn.Linear(2, 2)
    profile = StepProfile(model)
    x = torch.ones(1, 2)
    model(x)  # before the first step: not the training loop's, not counted

    class Worker:
        def work(self, seconds):
            time.sleep(seconds)
            return seconds

    worker = Worker()
    profile.time_phase(worker, "work", "sleep")
    scorer = SimpleNamespace(score=lambda: model(x))
    profile.time_phase(scorer, "score", "no-grad score", no_grad_only=True)

    profile.on_step_begin(None, None, None)
    with torch.no_grad():
        scorer.score()
    model(x)
    model(x)
    assert worker.work(0.02) == 0.02  # the wrapper returns the method's value
    profile.on_step_begin(None, None, None)
    scorer.score()  # grad enabled: a loss-style forward, not timed as the no-grad phase
    with torch.no_grad():
        model(x)
    profile.on_step_begin(None, None, None)

    assert profile.no_grad == [1, 1, 0] and profile.grad == [2, 1, 0]
    assert profile.phases[0]["sleep"] >= 0.02 and "sleep" not in profile.phases[1]
    assert "no-grad score" in profile.phases[0] and "no-grad score" not in profile.phases[1]
    assert profile.step_time(0) >= profile.phases[0]["sleep"]
    assert profile.step_time(0) == profile.starts[1] - profile.starts[0]
    assert profile.timed_steps(1) == [1]  # the last step's time is unknown until a next one starts


def test_step_profile_counts_the_completion_tokens_each_step_generated():
    profile = StepProfile(torch.nn.Linear(2, 2))
    # TRL 1.16's VLLMGeneration.generate returns (prompt_ids, completion_ids, logprobs, logprob_token_ids)
    engine = SimpleNamespace(generate=lambda prompts, n: ([[1]] * len(prompts), [[5] * k for k in prompts], None, None))
    profile.count_completion_tokens(engine)
    assert engine.generate([3], 1)[1] == [[5, 5, 5]]  # before the first step: returned, not counted
    profile.on_step_begin(None, None, None)
    engine.generate([3, 4], 2)
    engine.generate([1], 1)
    profile.on_step_begin(None, None, None)
    assert profile.completion_tokens == [8, 0]
