"""Live diagnostics of a run: the two Markdown logs, attention maps and the console summary.

The trainer builds one :class:`LiveDiagnostics` at construction (so a log path that cannot be written fails
before any model work) and calls :meth:`LiveDiagnostics.write` once per generation batch with rows already
gathered from every process; only the main process writes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from . import signals
from .attention import ModalityAttention
from .data.images import row_images
from .logs import AttentionLogWriter, RolloutLogWriter, default_log_paths, print_step_summary
from .attention_maps import attention_map_records
from .logs.maps import render_image_maps

LETTERS = "ABCDEFGHIJ"


def gold_answer(row: dict) -> str | None:
    """'B (red)' from a row's label_idx and choices; None when the row has no label."""
    label = row.get("label_idx")
    if label is None or (isinstance(label, float) and math.isnan(label)):
        return None
    label = int(label)
    choices = row.get("choices") or []
    letter = LETTERS[label] if 0 <= label < len(LETTERS) else str(label)
    return f"{letter} ({choices[label]})" if 0 <= label < len(choices) else letter


def completion_string(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in completion)
    return str(completion)


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
        accuracy = tuple(n for n in reward_names if n.startswith(("mc_idx", "accuracy")))
        # Constructing the writers checks the paths: a bad path fails here, with the path and the reason.
        self.rollouts = RolloutLogWriter(
            self.rollout_path, run_name=run, config=config, preview_chars=args.log_completion_preview_chars,
            full_rollouts_per_step=args.log_full_rollouts_per_step, row_preview_chars=args.log_prompt_preview_chars,
            num_generations=num_generations, accuracy_rewards=accuracy, colorize=args.colorize_output,
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

    # -------------------------------------------------------------------------------------------- writing
    def open(self, global_step: int) -> None:
        """Open lazily at the first write: a run that resumes from step N appends after its step-N block."""
        if self._opened or not self.is_main:
            return
        resume = global_step if global_step > 0 else None
        self.rollouts.open(resume_from_step=resume)
        if self.attention is not None:
            self.attention.open(resume_from_step=resume)
        self._opened = True

    def wants_layer_picture(self, step: int) -> bool:
        """Steps whose attention block links a per-layer MDI picture: step 1 and every attention_map_every_n_steps."""
        every = self.args.attention_map_every_n_steps
        return bool(self.args.compute_attention_metrics and every and (step == 1 or step % every == 0))

    def wants_maps(self, step: int) -> bool:
        """Steps that also draw attention maps (the same steps, when ``attention_maps_per_step`` > 0)."""
        return self.wants_layer_picture(step) and self.args.attention_maps_per_step > 0

    def _layer_picture(self, step: int, attention) -> str:
        """Draw this step's MDI by layer (the profile command's plotting code); the path relative to the log."""
        from .plots import plot_mdi_by_layer
        from .profile import layer_profile, mdi_curve

        path = self.attention.maps_dir / f"step{int(step):06d}_mdi_by_layer.png"
        curve = mdi_curve(layer_profile(attention, self.args.attention_layer_segments))
        plot_mdi_by_layer({f"step {step} ({attention.image.shape[0]} rollouts)": curve}, path,
                          title=f"MDI by layer · step {step}")
        return os.path.relpath(path, self.attention.path.parent)

    def write(self, step: int, epoch: float, records: list[dict], maps: list[dict], layers=None) -> None:
        """Write one generation batch (main process). ``records``: gathered per-rollout dicts; ``layers``: the batch's
        gathered ``ModalityAttention`` on steps that get a per-layer picture."""
        if not self.is_main:
            return
        self.open(step - 1)
        self.rollouts.write_step(step, epoch, [r["rollout"] for r in records])
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


def rollout_record(index: int, prompt, completion, images: list, rewards: dict, total: float | None,
                   advantage: float | None, row: dict, completion_length: int, attention: dict | None,
                   answer_format=None) -> dict:
    """One rollout, reduced to plain Python (cheap to gather across processes)."""
    sizes = [getattr(img, "size", None) for img in images]
    return {
        "rollout": {
            "index": index,
            "prompt": _without_image_payloads(prompt),
            "image_sizes": sizes,
            "completion": completion_string(completion),
            "rewards": rewards,
            "reward": total,
            "advantage": advantage,
            "answer": gold_answer(row),
            **_parsed_and_format(completion_string(completion), row, answer_format),
            "completion_length": completion_length,
        },
        "attention": None if attention is None else {**attention, "index": index},
    }


def _parsed_and_format(text: str, row: dict, answer_format) -> dict:
    """The answer letter as mc_idx reads it ("A/B" for a hedge) and whether the completion is in the asked format."""
    from .rewards import parse_mc_answer

    choices = row.get("choices")
    n = len(choices) if choices is not None and len(choices) > 0 else 10
    out = {"parsed": parse_mc_answer(text, n)[1]}
    if answer_format is not None:
        out["format_ok"] = bool(answer_format([text], choices=[choices])[0])
    return out


def _without_image_payloads(prompt: Any) -> Any:
    """The prompt messages with image parts reduced to placeholders (no PIL objects to pickle across ranks)."""
    if not isinstance(prompt, list):
        return prompt
    out = []
    for msg in prompt:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
            msg = {**msg, "content": content}
        out.append(msg)
    return out


class ConsoleSummaryCallback(TrainerCallback):
    """A colourised per-log summary next to the progress bar (plain text for NO_COLOR or non-TTY output)."""

    KEYS = ("reward", "rewards/mc_idx_reward/mean", "attention/mdi", "attention/mdi_balance",
            "tprl/scaling_factor_mean", "perf/tokens_per_second", "completions/mean_length")

    def __init__(self, colorize: bool):
        self.colorize = colorize

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        shown = {k: logs[k] for k in self.KEYS if k in logs}
        if shown:
            print_step_summary(state.global_step, shown, colorize=self.colorize)


def perception_strips(scores, completion_ids, completion_mask, tokenizer, *, top_p: float, signal: str,
                      rows: int) -> list[dict | None]:
    """For the first ``rows`` local rollouts, each completion token with its perception score and whether the
    perception filter keeps it (the same per-sequence top-p selection, ``top_p_token_mask``); None for the others."""
    from .forward import fit_width
    from .tprl import top_p_token_mask

    mask = completion_mask.bool().cpu()
    scores = fit_width(scores.float().cpu(), mask.shape[1])
    kept = top_p_token_mask(scores, mask, top_p)
    strips: list[dict | None] = []
    for i in range(len(mask)):
        if i >= rows:
            strips.append(None)
            continue
        ids = completion_ids[i].cpu()[mask[i]].tolist()
        strips.append({"signal": signal, "top_p": top_p, "tokens": [tokenizer.decode([t]) for t in ids],
                       "scores": scores[i][mask[i]].tolist(), "kept": kept[i][mask[i]].tolist()})
    return strips


def write_batch(live_logs: LiveDiagnostics, step: int, epoch: float, *, inputs: list[dict], scored, attention,
                map_rows: list[int], reward_names: list[str], reward_weights, advantages, segments_spec,
                processing_class, answer_format=None, strips: list[dict | None] | None = None) -> None:
    """One generation batch into the live logs: gathered from every process (all must call it), written by the main.

    ``scored`` is the batch's ``ScoredRollouts`` (rewards, signals, texts), ``attention`` its ``ModalityAttention``
    (None with metrics off), ``advantages`` already gathered, ``strips`` the local rows' ``perception_strips``.
    """
    records = gather_rollout_records(
        rows=inputs, prompts=scored.prompts, completions=scored.completions, lengths=scored.lengths,
        attention_rows=signals.rollout_rows(scored.signals) if scored.signals is not None else None,
        rewards=scored.rewards, reward_names=reward_names, reward_weights=reward_weights, advantages=advantages,
        answer_format=answer_format, strips=strips)
    maps = (attention_map_records(attention, [row_images(x) for x in inputs], map_rows, segments_spec,
                                  processing_class) if map_rows else [])
    layers = None
    if attention is not None and live_logs.wants_layer_picture(step):  # the same decision on every rank
        from accelerate.utils import gather_object

        light = dataclasses.replace(attention, image_token_mass={}, query_image_mass=None, token_layers=None)
        layers = ModalityAttention.cat(gather_object([light]))
    live_logs.write(step, epoch, records, maps, layers)


def gather_rollout_records(*, rows: list[dict], prompts: list, completions: list, lengths: list[int],
                           attention_rows: list[dict] | None, rewards, reward_names: list[str], reward_weights,
                           advantages, answer_format=None, strips: list[dict | None] | None = None) -> list[dict]:
    """Every process's rollouts of this batch as plain records, with rewards and advantages filled in.

    All processes must call it (it gathers). ``rows``/``prompts``/``completions``/``lengths``/``attention_rows`` are
    this process's; ``rewards`` (N_global, F) and ``advantages`` (N_global,) are already gathered.
    """
    from accelerate.utils import gather_object

    attention_rows = attention_rows if attention_rows is not None else [None] * len(rows)
    local = [
        rollout_record(i, p, c, row_images(x), {}, None, None, {k: x.get(k) for k in ("label_idx", "choices")}, n, a,
                       answer_format)
        for i, (p, c, x, n, a) in enumerate(zip(prompts, completions, rows, lengths, attention_rows))
    ]
    for rec, strip in zip(local, strips or []):
        if strip is not None:
            rec["rollout"]["perception"] = strip
    records = gather_object(local)
    totals = (rewards * reward_weights.to(rewards.device)).nansum(dim=1).tolist()
    advantages = advantages.tolist()
    for g, rec in enumerate(records):
        rec["rollout"]["index"] = g
        rec["rollout"]["rewards"] = {n: (None if math.isnan(v) else v) for n, v in zip(reward_names, rewards[g].tolist())}
        rec["rollout"]["reward"] = totals[g]
        rec["rollout"]["advantage"] = advantages[g]
        if rec["attention"] is not None:
            rec["attention"]["index"] = g
    return records
