"""The callback every benchmark's GRPO run trains with: held-out evaluation at chosen steps, kept out of the
training time, each step's time, and the metrics TRL logs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback


class EvaluateEvery(TrainerCallback):
    """Evaluates the model at the steps ``due(step, max_steps)`` picks, e.g. every N steps and the last one.

    ``evaluate(model, step, train_seconds)`` runs the benchmark's own held-out evaluation (recording and printing
    what it measured) and returns the seconds it took: they are subtracted from the training time
    (:meth:`train_seconds`) and from the next step's time, so that a run evaluated more often does not look slower.
    ``step_seconds``: a list that gets each step's training time (seconds, 3 decimals). ``record_step(step, logs)``:
    called with every log of a training step (the logs holding ``reward``).
    """

    def __init__(self, evaluate: Callable[[Any, int, float], float], due: Callable[[int, int], bool], *,
                 step_seconds: list[float] | None = None,
                 record_step: Callable[[int, dict], None] | None = None):
        self.evaluate, self.due, self.step_seconds, self.record_step = evaluate, due, step_seconds, record_step
        self.t0 = self.last = self.eval_seconds = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0, self.last = time.perf_counter(), 0.0

    def train_seconds(self) -> float:
        """Seconds since training began, less the evaluations' time."""
        return time.perf_counter() - self.t0 - self.eval_seconds

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step, elapsed = state.global_step, self.train_seconds()
        if self.step_seconds is not None:
            self.step_seconds.append(round(elapsed - self.last, 3))
            self.last = elapsed
        if self.due(step, state.max_steps):
            self.eval_seconds += self.evaluate(model, step, elapsed)
            self.last = self.train_seconds()  # the next step's time starts after the evaluation

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.record_step is not None and logs and "reward" in logs:
            self.record_step(state.global_step, logs)


def every(n: int) -> Callable[[int, int], bool]:
    """``due`` for every ``n``-th step and the last one."""
    return lambda step, max_steps: step % n == 0 or step == max_steps


def at(step: int | None) -> Callable[[int, int], bool]:
    """``due`` for one step only (None: never)."""
    return lambda s, max_steps: step is not None and s == step
