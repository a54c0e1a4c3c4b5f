"""The trainer's side of the diagnostics: the callbacks it registers and the one call it makes per batch.

The trainer builds one :class:`LiveDiagnostics` at construction (so a log path that cannot be written fails before
any model work) and, once per generation batch, calls :func:`write_batch` with a
:class:`~trl_mdi.diagnostics.batch_log.BatchLog` on every process: the rollouts are gathered, the main process writes
the two Markdown logs, the attention maps and the per-layer MDI picture. :class:`ConsoleSummaryCallback` prints a
short summary next to the progress bar.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

from .. import signals
from ..attention import ModalityAttention
from ..attention.layer_stats import layer_profile, mdi_curve
from ..data.images import row_images
from .answers import accuracy_rewards, console_reward_keys
from .batch_log import BatchLog, rollout_records
from .console import print_step_summary
from .log_file import LogPathError, check_writable, claim_log_paths, default_log_paths
from .maps import attention_map_records, render_image_maps
from .plots import plot_mdi_by_layer
from .writers import AttentionLogWriter, RolloutLogWriter

logger = logging.get_logger(__name__)


class LiveDiagnostics(TrainerCallback):
    """Owns the rollout log, the attention log and the attention-map folder of one run (a callback: it closes its
    files when training ends)."""

    def __init__(self, args, *, is_main_process: bool, reward_names: list[str], num_generations: int,
                 model_name: str = "", layers: str | None = None, segments: list[str] | None = None):
        self.args = args
        self.is_main = is_main_process
        self.reward_names = reward_names
        self.num_generations = num_generations
        self.started = time.time()
        run = args.run_name if args.run_name and args.run_name != args.output_dir else None
        # TRL_MDI_LOG_DIR moves the default folder (the test suite points it at a temporary directory).
        default_rollout, default_attention = default_log_paths(os.environ.get("TRL_MDI_LOG_DIR", "training_logs"), run)
        self.rollout_path = Path(args.rollout_log_path or default_rollout)
        self.attention_path = Path(args.attention_diag_log_path or default_attention)
        self.paths_given = bool(args.rollout_log_path or args.attention_diag_log_path)
        self._opened = False
        self.rollouts = self.attention = None
        if not self.is_main:
            return
        config = {
            "model": model_name or "(not given)",
            "rewards": ", ".join(f"{n} x{w:g}" for n, w in zip(reward_names, args.reward_weights or [1] * 99)),
            "num_generations": args.num_generations,
            "mdi_balance_ratio": args.mdi_balance_ratio,
            "tprl": ", ".join(k for k in ("enable_entropy_filtering", "enable_perception_filtering",
                                          "enable_trajectory_reweighting") if getattr(args, k)) or "off",
        }
        # Constructing the writers checks the paths: a bad path fails here, with the path and the reason.
        self.rollouts = RolloutLogWriter(
            self.rollout_path, run_name=run, config=config, preview_chars=args.log_completion_preview_chars,
            full_rollouts_per_step=args.log_full_rollouts_per_step, row_preview_chars=args.log_prompt_preview_chars,
            num_generations=num_generations, accuracy_rewards=accuracy_rewards(reward_names),
            colorize=args.colorize_output, counterfactual=getattr(args, "counterfactual_image", None),
        )
        # The attention log's header says which layers are measured (a hybrid model's linear-attention layers are not).
        attention_config = {**config, "segments": args.attention_layer_segments,
                            **({"measured layers": layers} if layers else {})}
        segments = list(segments or [])
        self.attention = (
            AttentionLogWriter(self.attention_path, columns=signals.log_columns(segments),
                               means=signals.log_means(segments), run_name=run, config=attention_config)
            if args.compute_attention_metrics else None
        )

    def open(self, global_step: int) -> None:
        """Open the logs (at train begin, or lazily at the first write of an evaluation). A run that resumes from
        step N continues its own logs after its step-N block, marking what it undoes; a fresh run gets files of its
        own: where another run's logs already are, the first free ``-K`` suffix (``claim_log_paths``), with a
        warning on the console."""
        if self._opened or not self.is_main:
            return
        writers = [w for w in (self.rollouts, self.attention) if w is not None]
        if global_step > 0:
            for w in writers:
                w.open(resume_from_step=global_step)
        else:
            wanted = [w.path for w in writers]
            try:
                claimed = claim_log_paths(wanted)
            except OSError as e:
                raise LogPathError(wanted[0], e.strerror or str(e)) from e
            if claimed != wanted:
                logger.warning("trl_mdi: %s already holds another run's log (kept as it is); this run writes %s",
                               ", ".join(map(str, wanted)), ", ".join(map(str, claimed)))
            for w, path in zip(writers, claimed):
                w.path = path
                w.open(claimed=True)
        self.rollout_path = self.rollouts.path
        if self.attention is not None:
            self.attention_path = self.attention.path
        self._opened = True

    def continue_logs(self, recorded: dict[str, str] | None) -> None:
        """Before a resume: write to the logs the checkpoint names (``log_paths`` at its save), so a resumed run
        continues its own logs whatever its ``--run_name`` or start time; explicit ``--rollout_log_path`` /
        ``--attention_diag_log_path`` win."""
        if not self.is_main or not recorded or self.paths_given or self._opened:
            return
        for key, w in (("rollouts", self.rollouts), ("attention", self.attention)):
            if w is not None and recorded.get(key):
                w.path = Path(recorded[key])
                check_writable(w.path)
        self.rollout_path = self.rollouts.path
        if self.attention is not None:
            self.attention_path = self.attention.path

    def log_paths(self) -> dict[str, str]:
        """The run's log files, absolute, recorded in each checkpoint so that a resume finds them."""
        if not self.is_main:
            return {}
        return {key: str(w.path.resolve()) for key, w in (("rollouts", self.rollouts), ("attention", self.attention))
                if w is not None}

    def stopped(self, step: int, error: BaseException) -> None:
        """A crash: "Run stopped at step ``step``" and the exception, as the logs' last lines (main process)."""
        if not self.is_main:
            return
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        for w in (self.rollouts, self.attention):
            if w is not None:
                w.stopped(step, reason)

    def on_train_begin(self, args, state, control, **kwargs):
        self.open(state.global_step)  # the checkpoint's step once TRL resumed: claims a fresh run's names at once

    def wants_layer_picture(self, step: int) -> bool:
        """Steps whose attention block links a per-layer MDI picture: step 1 and every attention_map_every_n_steps."""
        every = self.args.attention_map_every_n_steps
        return bool(self.args.compute_attention_metrics and every and (step == 1 or step % every == 0))

    def wants_maps(self, step: int) -> bool:
        """Steps that also draw attention maps (the same steps, when ``attention_maps_per_step`` > 0)."""
        return self.wants_layer_picture(step) and self.args.attention_maps_per_step > 0

    def _layer_picture(self, step: int, attention: ModalityAttention) -> str:
        """Draw this step's MDI by layer (the profile command's statistics and plot); the path relative to the log."""
        path = self.attention.maps_dir / f"step{int(step):06d}_mdi_by_layer.png"
        curve = mdi_curve(layer_profile(attention, self.args.attention_layer_segments))
        plot_mdi_by_layer({f"step {step} ({attention.image.shape[0]} rollouts)": curve}, path,
                          title=f"MDI by layer · step {step}")
        return os.path.relpath(path, self.attention.path.parent)

    def write(self, step: int, epoch: float, records: list[dict], maps: list[dict],
              layers: ModalityAttention | None = None, metrics: dict[str, float] | None = None) -> None:
        """Write one generation batch (main process). ``records``: every process's ``rollout_records``; ``maps``:
        ``attention_map_records``; ``layers``: the batch's gathered attention on steps that get a per-layer picture;
        ``metrics``: the batch's attention/* and reliance/* metrics (``BatchLog.metrics``)."""
        if not self.is_main:
            return
        self.open(step - 1)
        self.rollouts.write_step(step, epoch, [r["rollout"] for r in records], metrics=metrics)
        if self.attention is None:
            return
        summary: dict[str, Any] = {}
        links = []
        for m in maps:
            abs_path, rel = self.attention.map_path(step, m["index"])
            try:
                render_image_maps(m["images"], m["segments"], m["grid_hw"], abs_path, captions=m["captions"],
                                  title=f"step {step} · rollout {m['index']}")
                links.append((m["index"], rel))
            except (OSError, ValueError) as e:  # a map is a nicety: never stop training for one
                summary["map error"] = str(e)[:200]
        picture = None
        if layers is not None:
            try:
                picture = self._layer_picture(step, layers)
            except (OSError, ValueError) as e:
                summary["layer picture error"] = str(e)[:200]
        # Records arrive in TRL's order (each prompt's generations consecutive): the same # and group as the rollout log.
        ng = self.num_generations or 0
        rows = [{"index": i, **({"group": i // ng} if ng else {}), **r["attention"]}
                for i, r in enumerate(records) if r.get("attention") is not None]
        self.attention.write_step(step, epoch, rows, summary or None, maps=links, layer_picture=picture)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        for w in (self.rollouts, self.attention):
            if w is not None:
                w.close()


def write_batch(live_logs: LiveDiagnostics, batch: BatchLog, *, processing_class=None,
                answer_format: Callable[..., list[float]] | None = None) -> None:
    """One generation batch into the live logs: every process must call it (it gathers); the main process writes.

    ``processing_class`` gives the images' token grids for the attention maps; ``answer_format`` is the run's format
    check (``trl_mdi.rewards.ThinkFormatReward``), None for no format column.
    """
    from accelerate import PartialState
    from accelerate.utils import gather_object

    offset = PartialState().process_index * len(batch.rows)  # every process holds as many rows (TRL's sampler)
    records = gather_object(rollout_records(batch, offset=offset, answer_format=answer_format))
    maps = (attention_map_records(batch.attention, [row_images(x) for x in batch.rows], list(batch.map_rows),
                                  live_logs.args.attention_layer_segments, processing_class) if batch.map_rows else [])
    layers = None
    if batch.attention is not None and live_logs.wants_layer_picture(batch.step):  # the same decision on every rank
        light = dataclasses.replace(batch.attention, image_token_mass={}, query_image_mass=None, token_layers=None)
        layers = ModalityAttention.cat(gather_object([light]))
    live_logs.write(batch.step, batch.epoch, records, maps, layers, metrics=batch.metrics)


class ConsoleSummaryCallback(TrainerCallback):
    """A colourised per-log summary next to the progress bar (plain text for NO_COLOR or non-TTY output): the weighted
    reward, the accuracy rewards' means (``console_reward_keys``), MDI, balance, the blind-agreement rate of the reliance
    signals, throughput, completion length; each only when logged."""

    def __init__(self, colorize: bool, reward_names: Sequence[str]):
        self.colorize = colorize
        self.keys = ("reward", *console_reward_keys(reward_names), "attention/mdi", "attention/mdi_balance",
                     "reliance/blind_agree_rate", "tprl/scaling_factor_mean", "perf/tokens_per_second",
                     "completions/mean_length")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        shown = {k: logs[k] for k in self.keys if k in logs}
        if shown:
            print_step_summary(state.global_step, shown, colorize=self.colorize)
