"""SIGTERM, what SLURM (``--signal``, the time limit) and Kubernetes (eviction) send before they kill a job.

Python's default for SIGTERM is to die at once: no line in the logs, no checkpoint. While ``MDIGRPOTrainer.train``
runs, :func:`watch_sigterm` replaces it:

- **default**: the signal raises :class:`Preempted` where the run is; ``train`` writes "Run stopped" and why as the
  logs' last lines (as for any exception), and the process exits with status 143 (128 + SIGTERM), as it would have.
- **save_on_sigterm**: the signal only raises a flag. At the end of each optimizer step every process contributes
  its flag and all take the largest (:func:`any_process`): a signal seen by one process only (or by each at a
  different moment) still makes all of them save the same ``checkpoint-N`` together (ZeRO-3's save is collective; a
  process saving alone would hang the others). Training stops after that save, the logs say so, and ``train``
  raises :class:`Preempted` (status 143): a script never goes on as if training had finished. A second SIGTERM
  stops at once.

The time this needs is the rest of the step in progress plus one save (:class:`PreemptionCallback` measures a step
and its save, and warns once when they take longer than a launcher grants: under ``accelerate launch`` / torchrun,
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, 30 by default, between forwarding SIGTERM to the workers and SIGKILL).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from transformers import TrainerCallback

EXIT_STATUS = 128 + signal.SIGTERM  # 143: what the shell reports for a process killed by SIGTERM


class Preempted(SystemExit):
    """The run stopped on SIGTERM; exits the process with status 143 unless caught. ``checkpoint``: the whole
    checkpoint saved on the way out (save_on_sigterm), else None."""

    def __init__(self, message: str, checkpoint: str | None = None):
        super().__init__(EXIT_STATUS)
        self.message, self.checkpoint = message, checkpoint

    def __str__(self) -> str:
        return self.message


@dataclass
class SigtermWatch:
    """What the handler saw: ``requested`` once a SIGTERM arrived (save_on_sigterm), ``step`` the step in progress
    then (global step + 1)."""

    save: bool
    requested: bool = False
    step: int | None = None
    installed: bool = False
    raised: Preempted | None = None

    def as_raised(self, error: BaseException) -> BaseException:
        """The exception a run stopped by ``error`` should end with: the :class:`Preempted` this watch's handler
        raised, when code the signal interrupted swallowed or rewrapped it (a C extension's module init, interrupted
        mid-import, turns it into ``ImportError: initialization failed``; the process would exit 1, not 143), else
        ``error`` itself (raise it ``from error``)."""
        return error if self.raised is None else self.raised


@contextmanager
def watch_sigterm(save: bool, step: Callable[[], int]) -> Iterator[SigtermWatch]:
    """SIGTERM handled as the module docstring says while the block runs (``step()``: the current global step, for
    the messages); the previous handler is put back after. Outside the main thread (where Python cannot install a
    handler) nothing changes."""
    watch = SigtermWatch(save=save)
    if threading.current_thread() is not threading.main_thread():
        yield watch
        return

    def handler(signum, frame):
        now = step() + 1  # the step in progress
        if not save or watch.requested:
            again = " (a second SIGTERM while the checkpoint was pending)" if watch.requested else ""
            watch.raised = Preempted(f"SIGTERM during step {now}{again}: stopped at once, no checkpoint saved"
                                     + ("" if save else " (save_on_sigterm is off)") + "; resume from the last checkpoint")
            raise watch.raised
        watch.requested, watch.step = True, now

    previous = signal.signal(signal.SIGTERM, handler)
    watch.installed = True
    try:
        yield watch
    finally:
        signal.signal(signal.SIGTERM, previous)


def any_process(flag: bool, gather: Callable | None) -> bool:
    """Whether ``flag`` is set on any process: ``gather`` concatenates a tensor over every process (None: one
    process). Every process must call it, at the same point.

    >>> import torch
    >>> any_process(False, lambda t: torch.cat([t, torch.tensor([1])]))  # set on the other process only
    True
    >>> any_process(False, None)
    False
    """
    if gather is None:
        return flag
    import torch

    return bool(gather(torch.tensor([int(flag)])).max() > 0)


def launcher_grace_seconds() -> float | None:
    """Seconds a torchrun-style launcher (``accelerate launch`` with several processes) waits between forwarding
    SIGTERM to the workers and killing them; None when not launched so."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))


def preempted_message(signal_step: int | None, step: int, folder: str) -> str:
    """The line a run stopped by SIGTERM after saving writes to its logs and console.

    >>> preempted_message(4, 4, "out/checkpoint-4")
    'SIGTERM during step 4: saved checkpoint out/checkpoint-4 (step 4) on every process and stopped (save_on_sigterm); resume with --resume_from_checkpoint true'
    """
    arrived = f"SIGTERM during step {signal_step}" if signal_step is not None else "SIGTERM on another process"
    return (f"{arrived}: saved checkpoint {folder} (step {step}) on every process and stopped (save_on_sigterm); "
            "resume with --resume_from_checkpoint true")


class PreemptionCallback(TrainerCallback):
    """With save_on_sigterm: at each optimizer step's end, the processes agree (``agree``: :func:`any_process` over
    them) whether a SIGTERM arrived; if so that step's checkpoint is saved and training stops. Once saved,
    ``on_stop(step, signal_step)`` gives the exception ``train`` raises (``exit``). Warns once (``warn``) when a step
    plus its save took longer than the launcher's grace period."""

    def __init__(self, watch: SigtermWatch, agree: Callable[[bool], bool], warn: Callable[[str], None],
                 on_stop: Callable[[int, int | None], Preempted]):
        self.watch, self.agree, self.warn, self.on_stop = watch, agree, warn, on_stop
        self.stopping: int | None = None
        self.exit: Preempted | None = None
        self._step_started = 0.0
        self._warned = False

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopping is None and self.agree(self.watch.requested):
            self.stopping = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def outcome(self) -> Preempted | None:
        """After training: the exception that ends the run, None when no SIGTERM stopped it. A stop whose save the
        Trainer skipped (``save_strategy="best"`` saves a new best only) ends it all the same, saying so."""
        if self.stopping is None:
            return None
        if self.exit is None:
            self.exit = Preempted(f"SIGTERM during step {self.watch.step}: stopped at step {self.stopping} without a "
                                  "checkpoint (save_strategy 'best' saved none); resume from the last one")
            self.warn(str(self.exit))
        return self.exit

    def on_save(self, args, state, control, **kwargs):
        if self.stopping is not None and state.global_step == self.stopping and self.exit is None:
            self.exit = self.on_stop(state.global_step, self.watch.step)
        grace = launcher_grace_seconds()
        took = time.monotonic() - self._step_started
        if grace is not None and took > grace and not self._warned:
            self._warned = True
            self.warn(f"save_on_sigterm: a step and its checkpoint save took {took:.0f} s, longer than the "
                      f"{grace:.0f} s the launcher waits between forwarding SIGTERM and killing the workers: a "
                      "SIGTERM would kill the run before its checkpoint. Raise TORCH_ELASTIC_SHUTDOWN_TIMEOUT (and "
                      "SLURM's --signal lead time) above it")


__all__ = ["EXIT_STATUS", "PreemptionCallback", "Preempted", "SigtermWatch", "any_process", "launcher_grace_seconds",
           "preempted_message", "watch_sigterm"]
