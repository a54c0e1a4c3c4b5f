"""The two live Markdown logs: rollouts (prompt, completion, rewards) and attention diagnostics (MDI / AEI).

Both are written by the main process only, with rows already gathered from every process. File mechanics
(header, fsync, resume, write failures) are in :mod:`trl_mdi.diagnostics.log_file`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from .log_file import StepLogFile
from .markdown import Markdown, clean, code_span, escape_inline, fence, format_value, md_table, trend_line

if TYPE_CHECKING:
    from ..signals import Signal

# The counterfactual I' of the signals (MDIGRPOConfig.counterfactual_image), as the full rollouts name it.
COUNTERFACTUALS = {
    "none": "the prompt without its image", "grey": "a grey image of the same size",
    "black": "a black image of the same size", "blur": "the image blurred",
    "gaussian_noise": "the image under Gaussian noise", "patch_blackening": "the image with patches blacked out",
    "grayscale": "the image in grey tones (its colour removed)",
}

# Image placeholders of chat-templated prompt strings: Qwen-VL's vision span, runs of its pad token, "<image>".
_IMAGE_SPAN = re.compile(r"<\|vision_start\|>.*?<\|vision_end\|>|(?:<\|image_pad\|>)+|(?:<image>)+", re.DOTALL)


def _table():
    """``trl_mdi.signals``, whose ``SIGNALS`` say which reliance columns, words and summary rows a rollout gets.
    Imported on first use: it imports the attention probe and with it transformers, and the writers load without
    them (tests/test_logs.py). The module is read at each call, so a table changed at run time is seen."""
    from .. import signals

    return signals


def _mean(values: Iterable[Any]) -> float | None:
    """Mean of the finite values (None and NaN are undefined, +inf MDI is counted elsewhere): None if there is none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def _image_label(size: Any) -> str:
    size = getattr(size, "size", size)  # a PIL image or a (width, height) pair
    try:
        w, h = (int(x) for x in size)
        return f"[image {w}x{h}]"
    except (TypeError, ValueError):
        return "[image]"


def prompt_text(prompt: Any, image_sizes: Sequence[Any] = ()) -> str:
    """The prompt as plain text with each image shown as ``[image WxH]`` (sizes in order of appearance).

    ``prompt`` is a string (image placeholders of the chat template are replaced) or TRL's conversational
    form (a list of ``{"role", "content"}`` messages, content a string or parts ``{"type": "image"|"text"}``).
    Sizes with no placeholder to replace are listed first.

    >>> prompt_text([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}], [(56, 56)])
    'user: [image 56x56] Color?'
    >>> prompt_text("<|vision_start|><|image_pad|><|vision_end|>Color?", [(8, 4)])
    '[image 8x4]Color?'
    """
    sizes = list(image_sizes or ())
    used = 0

    def next_image(_match: Any = None) -> str:
        nonlocal used
        label = _image_label(sizes[used]) if used < len(sizes) else "[image]"
        used += 1
        return label

    if isinstance(prompt, dict):
        prompt = [prompt]
    if isinstance(prompt, list):
        lines = []
        for msg in prompt:
            content = msg.get("content", "") if isinstance(msg, dict) else msg
            if isinstance(content, list):
                parts = [next_image() if isinstance(p, dict) and p.get("type") in ("image", "image_url")
                         else str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content]
                content = " ".join(parts)
            role = msg.get("role", "") if isinstance(msg, dict) else ""
            lines.append(f"{role}: {content}" if role else str(content))
        text = "\n".join(lines)
    else:
        text = _IMAGE_SPAN.sub(next_image, "" if prompt is None else str(prompt))
    if used < len(sizes):
        text = " ".join(_image_label(s) for s in sizes[used:]) + "\n" + text
    return text


def message_text(x: Any) -> str:
    """Text of a completion given as a string or as messages (contents joined by newlines)."""
    if isinstance(x, dict):
        x = [x]
    if isinstance(x, list):
        return "\n".join(prompt_text(m["content"] if isinstance(m, dict) and "content" in m else m) for m in x)
    return "" if x is None else str(x)


# ---------------------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------------------
class RolloutLogWriter(StepLogFile):
    """Per step: the first ``full_rollouts_per_step`` rollouts in full, the others one table row each, a summary.

    A rollout is a dict with (all optional except ``completion``):
        prompt (str or messages), image_sizes ([(w, h), ...] or PIL images), completion (str or messages),
        rewards ({name: value or None}, unweighted components), reward (weighted total), advantage,
        answer (gold), parsed (the letter the answer reward read; "A/B" for a hedge), format_ok (whether the
        completion is in the asked format), correct (bool; else derived from the first reward named in
        ``accuracy_rewards``, > 0),
        group (prompt group id; else consecutive blocks of ``num_generations``), completion_length (tokens),
        index (shown as #; default its position), skipped (why the rollout left the update, e.g. "unreadable image":
        shown in its heading, counted in the summary; its reward is None, never 0),
        and the counterfactual reliance signals (``trl_mdi.signals.reliance_names()``: visual_gain,
        answer_visual_gain, blind_agrees as 1 / 0, ...; None where undefined; ``counterfactual`` names the I' they
        compare the image with).

    The table of other rollouts has a ``parsed``, ``gold`` and ``format`` column only when some rollout of the step
    has that key (``trl_mdi.diagnostics.answers``: a free-form task has no parsed letter and no format verdict).
    A step whose rollouts carry reliance signals also gets, and only then (a run without them logs the same bytes as
    before they existed), all read from the signal table (``trl_mdi.signals.SIGNALS``, counterfactual entries): a
    column per signal with a ``log`` header (``vis gain``, ``ans gain``, ``blind``...), a "Reliance on the image" line
    in each full rollout (each signal's ``words``), a summary row per metric signal (:func:`reliance_summary`) and
    the answer rate, and a trend line of each 0/1 ``flag``'s rate (the blind agreement).
    """

    kind = "rollout"
    title = "Rollout log"

    def __init__(self, path: str | os.PathLike, *, run_name: str | None = None, config: dict | None = None,
                 preview_chars: int = 2000, full_rollouts_per_step: int = 2, row_preview_chars: int = 80,
                 num_generations: int | None = None, accuracy_rewards: Sequence[str] = ("mc_idx", "accuracy"),
                 colorize: bool = True, trend_width: int = 60, counterfactual: str | None = None):
        super().__init__(path, run_name=run_name, config=config)
        self.counterfactual = counterfactual
        self.preview_chars = preview_chars
        self.full_rollouts_per_step = full_rollouts_per_step
        self.row_preview_chars = row_preview_chars
        self.num_generations = num_generations
        self.accuracy_rewards = tuple(accuracy_rewards)
        self.colorize = colorize
        self.trend_width = trend_width

    def _correct(self, r: dict) -> bool | None:
        if "correct" in r:
            return None if r["correct"] is None else bool(r["correct"])
        for name in self.accuracy_rewards:
            value = (r.get("rewards") or {}).get(name)
            if value is not None and not math.isnan(float(value)):
                return float(value) > 0
        return None

    def _mark(self, correct: bool | None) -> str:
        if correct is None:
            return "—"
        if self.colorize:
            return "✅" if correct else "❌"
        return "correct" if correct else "wrong"

    def _group_of(self, r: dict, pos: int) -> Any:
        """The rollout's prompt group: its ``group``, else its block of ``num_generations`` (rollouts arrive in
        TRL's order, each prompt's generations consecutive), else unknown."""
        if r.get("group") is not None:
            return r["group"]
        return pos // self.num_generations if self.num_generations else None

    def _groups(self, rollouts: list[dict]) -> list[list[float | None]] | None:
        if all("group" in r for r in rollouts):
            groups: dict[Any, list] = {}
            for r in rollouts:
                groups.setdefault(r["group"], []).append(r.get("reward"))
            return list(groups.values())
        if self.num_generations:
            g = self.num_generations
            return [[r.get("reward") for r in rollouts[i : i + g]] for i in range(0, len(rollouts), g)]
        return None

    def write_step(self, step: int, epoch: float | None, rollouts: list[dict], summary: dict | None = None,
                   metrics: Mapping[str, float] | None = None) -> bool:
        """Append one step block; returns False when it was not written (failed or disabled log). ``metrics``: the
        batch's ``reliance/*`` metrics as the trainer logged them (``trl_mdi.signals.BatchSignals.metrics``), read by
        the step summary's reliance rows (:func:`reliance_summary`); None: computed from ``rollouts``."""
        if self.failed:
            self.dropped_writes += 1
            return False
        names: list[str] = []
        for r in rollouts:
            names += [k for k in (r.get("rewards") or {}) if k not in names]
        parts = []
        full, rest = rollouts[: self.full_rollouts_per_step], rollouts[self.full_rollouts_per_step :]
        for pos, r in enumerate(full):
            parts.append(self._full(r, pos, names, self._group_of(r, pos)))
        # Image counts get a column only where they tell something: a mixed or multi-image batch.
        n_images = [len(r.get("image_sizes") or ()) for r in rollouts]
        show_images = len(set(n_images)) > 1 or max(n_images, default=0) > 1
        if rest:
            parts.append(f"### Other rollouts ({len(rest)})\n")
            # The task's columns, where some rollout of the step has them (a free-form task: no parsed, no format).
            task = [(key, label) for key, label in (("parsed", "parsed"), ("answer", "gold"), ("format_ok", "format"))
                    if any(key in r for r in rollouts)]
            table = _table()  # the reliance columns: the counterfactual signals with a log header
            reliance = [(key, label) for key, label in table.rollout_log_columns() if any(key in r for r in rollouts)]
            header = ["#", "group", *(["images"] if show_images else []), *names, "total", "advantage", "correct",
                      "length", *[label for _, label in task], *[label for _, label in reliance], "completion"]
            rows = []
            for pos, r in enumerate(rest, start=len(full)):
                text = clean(message_text(r.get("completion")))
                preview = clean(text, self.row_preview_chars)
                rewards = r.get("rewards") or {}
                cells = {"parsed": r.get("parsed"), "format_ok": self._format_mark(r.get("format_ok")),
                         "answer": None if r.get("answer") is None else clean(r["answer"], self.row_preview_chars)}
                rows.append([r.get("index", pos), self._group_of(r, pos), *([n_images[pos]] if show_images else []),
                             *[rewards.get(n) for n in names], r.get("reward"),
                             r.get("advantage"), self._mark(self._correct(r)), r.get("completion_length", len(text)),
                             *[cells[key] for key, _ in task],
                             *[table.rollout_log_cell(key, r.get(key)) for key, _ in reliance], preview])
            parts.append(md_table(header, rows))
        stats = self._summary(rollouts, names, metrics)
        if show_images:
            stats["rollouts by images in the prompt"] = " · ".join(
                f"{k} image{'s' if k != 1 else ''}: {n_images.count(k)}" for k in sorted(set(n_images)))
        parts.append("### Step summary\n")
        rows = [[k, v] for k, v in stats.items()] + [[k, v] for k, v in (summary or {}).items()]
        parts.append(md_table(["metric", "value"], [[k, _cell(v)] for k, v in rows]))
        data = {"reward": stats.get("reward (weighted) mean"), "accuracy": stats.get("accuracy")}
        # Each 0/1 reliance flag's rate gets a trend (the blind agreement); its value rides in the block's end marker,
        # so a resumed log rebuilds it.
        trends = [(key, title) for key, label, title in _flag_trends() if label in stats]
        data.update({key: stats[label] for key, label, _ in _flag_trends() if label in stats})
        history = [d for _, d in self.records] + [data]
        lines = [trend_line([d.get("reward") for d in history], self.trend_width, "Mean reward trend:"),
                 trend_line([d.get("accuracy") for d in history], self.trend_width, "Accuracy trend:"),
                 *[trend_line([d.get(key) for d in history], self.trend_width, title) for key, title in trends]]
        parts += [line + "  " for line in lines[:-1]] + lines[-1:]
        return self._write_block(step, epoch, "\n".join(parts), data)

    def _full(self, r: dict, pos: int, names: list[str], group: Any = None) -> str:
        idx = r.get("index", pos)
        title = f"### Rollout {idx}"
        if group is not None:
            title += f" · group {escape_inline(group)}"
        title += f" · reward {format_value(r.get('reward'))} · advantage {format_value(r.get('advantage'))}"
        if r.get("skipped"):
            title += f" · skipped ({escape_inline(r['skipped'])})"
        correct = self._correct(r)
        if correct is not None:
            title += f" · {self._mark(correct)}"
        sizes = r.get("image_sizes") or ()
        prompt = clean(prompt_text(r.get("prompt"), sizes), self.preview_chars)
        text = clean(message_text(r.get("completion")))
        length = f"{len(text)} chars" + (f", {r['completion_length']} tokens" if "completion_length" in r else "")
        rewards = r.get("rewards") or {}
        table = [[n, rewards.get(n)] for n in names] + [[Markdown("**total (weighted)**"), r.get("reward")],
                                                        ["advantage", r.get("advantage")]]
        out = [title, "", f"**Prompt** · {len(sizes)} image(s)", "", fence(prompt, "text"),
               f"**Completion** · {length}", "", fence(clean(text, self.preview_chars), "text")]
        answer = [f"**Parsed answer:** {escape_inline(r['parsed'])}"] if r.get("parsed") is not None else []
        if "parsed" in r and r.get("parsed") is None:
            answer = ["**Parsed answer:** none"]
        if r.get("answer") is not None:
            answer.append(f"**Gold answer:** {escape_inline(clean(r['answer'], self.preview_chars))}")
        if r.get("format_ok") is not None:
            answer.append(f"**Format:** {self._format_mark(r['format_ok'])}")
        if answer:
            out += [" · ".join(answer), ""]
        if any(name in r for name in _table().reliance_names()):
            out += [self._reliance_line(r), ""]
        if r.get("image_evidence") is not None:
            out += [image_evidence_line(r["image_evidence"]), ""]
        out += [md_table(["reward", "value"], table)]
        if r.get("perception"):
            out += ["", *perception_strip_lines(r["perception"])]
        return "\n".join(out)

    def _reliance_line(self, r: dict) -> str:
        """One full rollout's reliance signals in words: what each number says about where the answer came from."""
        kind = self.counterfactual
        head = (f"**Reliance on the image** (counterfactual: {COUNTERFACTUALS.get(kind, escape_inline(kind))}):" if kind
                else "**Reliance on the image:**")
        if "image_sizes" in r and not r["image_sizes"]:
            return f"{head} — (no image in the prompt)"
        return f"{head} " + " · ".join(escape_inline(phrase) for phrase in _table().reliance_words(r))

    def _format_mark(self, ok: bool | None) -> str | None:
        if ok is None:
            return None
        return ("✅ asked" if ok else "✗ not the asked format") if self.colorize else ("asked" if ok else "not asked")

    def _summary(self, rollouts: list[dict], names: list[str], metrics: Mapping[str, float] | None = None
                 ) -> dict[str, Any]:
        stats: dict[str, Any] = {"rollouts": len(rollouts)}
        skipped = sum(1 for r in rollouts if r.get("skipped"))
        if skipped:  # left out of the update: not scored, so out of every mean below (never a reward of 0)
            stats["skipped (unreadable image: out of the update and of these means)"] = skipped
        stats["reward (weighted) mean"] = _mean(r.get("reward") for r in rollouts)
        for n in names:
            stats[f"{n} mean"] = _mean((r.get("rewards") or {}).get(n) for r in rollouts)
        stats["advantage mean |A|"] = _mean(None if r.get("advantage") is None else abs(r["advantage"]) for r in rollouts)
        verdicts = [c for c in (self._correct(r) for r in rollouts) if c is not None]
        stats["accuracy"] = sum(verdicts) / len(verdicts) if verdicts else None
        formats = [r["format_ok"] for r in rollouts if r.get("format_ok") is not None and not r.get("skipped")]
        if formats:
            stats["clean format (asked answer line)"] = sum(formats) / len(formats)
        tokens = all("completion_length" in r for r in rollouts)
        lengths = [r["completion_length"] if tokens else len(clean(message_text(r.get("completion")))) for r in rollouts]
        if lengths:
            unit = "tokens" if tokens else "chars"
            stats[f"completion length mean ({unit})"] = sum(lengths) / len(lengths)
            stats[f"completion length min / max ({unit})"] = f"{min(lengths)} / {max(lengths)}"
        groups = self._groups(rollouts)
        if groups is not None:
            flat = 0
            for g in groups:
                vals = [float(v) for v in g if v is not None and not math.isnan(float(v))]
                flat += len(vals) <= 1 or max(vals) == min(vals)
            stats["groups with zero reward spread"] = f"{flat} / {len(groups)}"
        if any(name in r for r in rollouts for name in _table().reliance_names()):
            stats.update(reliance_summary(rollouts, metrics))
        return stats


ANSWER_RATE = "answer rate (rollouts with an image and an answer)"


def summary_label(signal: Signal) -> str:
    """A counterfactual signal's row in the rollout log's step summary: its ``label``, else its column header (or
    name) with "mean", or "rate" for a 0/1 flag.

    >>> from trl_mdi.signals import COUNTERFACTUAL, Signal
    >>> summary_label(Signal("max_token_gain", "", lambda x: None, source=COUNTERFACTUAL, log="max gain"))
    'max gain mean'
    """
    return signal.label or f"{signal.log or signal.name.replace('_', ' ')} {'rate' if signal.flag else 'mean'}"


def _flag_trends() -> list[tuple[str, str, str]]:
    """(key in the step's end marker, summary label, trend title) of each counterfactual 0/1 flag: the key is its
    metric's name without prefix and ``_rate`` (``blind_agree``), the title its label up to a parenthesis."""
    table, out = _table(), []
    for s in table.SIGNALS:
        if s.source == table.COUNTERFACTUAL and s.metric and s.flag:
            label = summary_label(s)
            key = s.metric_key.split("/", 1)[-1].removesuffix("_rate")
            out.append((key, label, f"{label.split(' (', 1)[0].capitalize()} trend:"))
    return out


def reliance_summary(rollouts: list[dict], metrics: Mapping[str, float] | None = None) -> dict[str, float | None]:
    """The step summary's reliance rows, read from the batch's ``reliance/*`` metrics (``metrics``: computed once by
    ``trl_mdi.signals.batch_metrics`` over the gathered batch, the values the trainer logs; None: that function over
    these rollouts' values): one row per counterfactual metric signal of the table that some rollout carries, in
    table order (the mean where finite; a 0/1 flag's mean is its rate over the rollouts with a verdict), then the
    answer rate (``reliance/answer_rate``), the share of all rollouts with an answer visual gain.

    >>> stats = reliance_summary([{"visual_gain": 0.5, "answer_visual_gain": 2.0, "blind_agrees": 0.0},
    ...                           {"visual_gain": 0.1, "answer_visual_gain": -1.0, "blind_agrees": 1.0},
    ...                           {"visual_gain": 0.4, "answer_visual_gain": None, "blind_agrees": None}])
    >>> [round(v, 3) for v in stats.values()]  # gain, answer gain, blind agreement, answer rate
    [0.333, 0.5, 0.5, 0.667]
    """
    table = _table()
    carried = [s for s in table.SIGNALS if s.source == table.COUNTERFACTUAL and s.metric
               and any(s.name in r for r in rollouts)]
    if metrics is None:
        import torch

        names = {s.name for s in carried} | ({"answer_visual_gain"} if any("answer_visual_gain" in r for r in rollouts)
                                             else set())
        metrics = table.batch_metrics({n: torch.tensor([math.nan if r.get(n) is None else float(r[n])
                                                        for r in rollouts], dtype=torch.float64) for n in names})
    stats = {summary_label(s): metrics.get(s.metric_key) for s in carried}
    if any("answer_visual_gain" in r for r in rollouts):
        stats[ANSWER_RATE] = metrics.get("reliance/answer_rate")
    return stats


def image_evidence_line(evidence: dict) -> str:
    """A rollout's completion on one line with the tokens the image made likeliest in **bold**
    (``trl_mdi.diagnostics.batch_log.image_evidence``), each with its gain; or a line saying that no token reached
    the threshold (the answer was written the same without the image).

    >>> image_evidence_line({"tokens": [" the", " shape", " is", " red"], "marked": [3], "gains": [4.41],
    ...                      "min_gain": 1.0})
    '**Image evidence** (tokens at least 1 nat likelier with the image): the shape is **red** · `red` +4.41'
    >>> image_evidence_line({"tokens": [" a", " tomato"], "marked": [], "gains": [], "min_gain": 1.0})
    '**Image evidence:** none (no completion token is 1 nat likelier with the image than without)'
    """
    nats = f"{evidence['min_gain']:g} nat" + ("" if evidence["min_gain"] == 1 else "s")
    if not evidence["marked"]:
        return f"**Image evidence:** none (no completion token is {nats} likelier with the image than without)"
    return f"**Image evidence** (tokens at least {nats} likelier with the image): {marked_completion(evidence)}"


def marked_completion(evidence: dict, *, markdown: bool = True) -> str:
    """The completion with its image-evidence tokens in **bold**, then each marked token's gain (the rollout log's
    image-evidence line without its label); the plain completion when no token is marked. ``markdown=False``: the
    tokens' own text, unescaped (the completions table's ``image_evidence`` cell, read in pandas and the trackers).

    Consecutive marked tokens share one bold span, and the text between them is escaped as a whole
    (``trl_mdi.diagnostics.markdown.escape_inline``), so a link split over two tokens is still no link. A span that
    starts or ends with punctuation is bold in HTML (``<b>``): Markdown's ``**`` would not open after a letter there.

    >>> marked_completion({"tokens": [" the", " shape", " is", " red"], "marked": [3], "gains": [4.41]})
    'the shape is **red** · `red` +4.41'
    >>> marked_completion({"tokens": [" it", " is", "<", "b", ">"], "marked": [2, 3, 4], "gains": [1.0, 2.0, 3.0]})
    'it is<b>&lt;b&gt;</b> · `<` +1 · `b` +2 · `>` +3'
    >>> marked_completion({"tokens": ["<b>", "\\n", "A"], "marked": [2], "gains": [2.0]}, markdown=False)
    '<b>\\n**A** · `A` +2'
    >>> marked_completion({"tokens": [" a", " tomato"], "marked": [], "gains": []})
    'a tomato'
    """
    esc = escape_inline if markdown else str
    marked = set(evidence["marked"])
    runs: list[tuple[bool, str]] = []  # (marked, text) of consecutive tokens alike
    for i, t in enumerate(evidence["tokens"]):
        if runs and runs[-1][0] == (i in marked):
            runs[-1] = (runs[-1][0], runs[-1][1] + t)
        else:
            runs.append((i in marked, t))
    parts = []
    for is_marked, t in runs:
        body = t.strip()
        if not (is_marked and body):
            parts.append(esc(t))
            continue
        lead, trail = t[: len(t) - len(t.lstrip())], t[len(t.rstrip()):]  # spaces stay outside the bold
        shown = esc(body)
        bold = f"**{shown}**" if not markdown or (body[0].isalnum() and body[-1].isalnum()) else f"<b>{shown}</b>"
        parts.append(esc(lead) + bold + esc(trail))
    text = "".join(parts)
    if not marked:
        return text.strip()
    # Each marked token as code: a code span longer than any backtick run in it (a lone "`" token would otherwise
    # close the span and garble the line); the unescaped text when the cell is not Markdown.
    show = (lambda t: code_span(t.strip() or repr(t))) if markdown else (lambda t: f"`{t.strip()}`")
    gains = " · ".join(f"{show(evidence['tokens'][i])} {g:+.3g}" for i, g in zip(evidence["marked"], evidence["gains"]))
    return f"{text.strip()} · {gains}"


def perception_strip_lines(strip: dict, top: int = 5) -> list[str]:
    """A rollout's completion with the tokens the perception filter keeps in ⟦brackets⟧, then its top tokens."""
    tokens, scores, kept = strip["tokens"], strip["scores"], strip["kept"]
    marked = "".join(f"⟦{t}⟧" if k else t for t, k in zip(tokens, kept))
    best = sorted(range(len(tokens)), key=lambda i: -scores[i])[:top]
    ranked = " · ".join(f"{code_span(tokens[i].strip() or repr(tokens[i]))} {format_value(scores[i])}" for i in best)
    head = (f"**Perception ({strip['signal']})** · ⟦kept⟧ = each completion's top {strip['top_p']:.0%} of tokens, "
            f"{sum(kept)} of {len(tokens)}")
    return [head, "", fence(clean(marked), "text"), f"Highest: {ranked}", ""]


def _cell(v: Any) -> Any:
    """Numbers (numpy / torch scalars included) stay numbers for format_value; anything else becomes text."""
    scalar = hasattr(v, "item") and getattr(v, "ndim", None) == 0
    return v if v is None or scalar or isinstance(v, (int, float, str)) else str(v)


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------
class AttentionLogWriter(StepLogFile):
    """Per step: one table row per rollout (the ``columns`` given: MDI per layer segment, AEI, token counts,
    balance), a summary of the ``means``, trend lines of the mean MDI and balance over the run, and links to
    attention-map PNGs.

    Rows are per-rollout dicts keyed by signal name (``trl_mdi.signals.rollout_rows``), optionally with ``group`` /
    ``index``; ``columns`` and ``means`` are ``(key, label)`` pairs (``trl_mdi.signals.log_columns`` /
    ``log_means``). The trends read ``mdi`` and ``mdi_balance`` and are rebuilt on resume from the step blocks kept
    in the file.
    """

    kind = "attention"
    title = "Attention diagnostics"

    def __init__(self, path: str | os.PathLike, *, columns: Sequence[tuple[str, str]],
                 means: Sequence[tuple[str, str]] = (), run_name: str | None = None, config: dict | None = None,
                 trend_width: int = 60, maps_dir: str | os.PathLike | None = None):
        super().__init__(path, run_name=run_name, config=config)
        self.columns, self.means = list(columns), list(means)
        self.trend_width = trend_width
        self._maps_dir = Path(maps_dir) if maps_dir is not None else None

    @property
    def maps_dir(self) -> Path:
        """Where the attention maps go: the given folder, else ``<log stem>_maps`` beside the log (it follows the log
        when a fresh run is given a fresh name, so two runs never share a folder)."""
        return self._maps_dir if self._maps_dir is not None else self.path.with_name(self.path.stem + "_maps")

    def map_path(self, step: int, rollout_index: int, tag: str = "") -> tuple[Path, str]:
        """(where to save a map PNG, the path relative to the log to pass to ``write_step``)."""
        name = f"step{int(step):06d}_rollout{int(rollout_index):04d}{'_' + tag if tag else ''}.png"
        path = self.maps_dir / name
        return path, Path(os.path.relpath(path, self.path.parent)).as_posix()

    def write_step(self, step: int, epoch: float | None, rollouts: list[dict], summary: dict | None = None,
                   maps: Sequence[tuple[int, str]] = (), layer_picture: str | None = None) -> bool:
        """Append one step block; returns False when it was not written (failed or disabled log). ``layer_picture``:
        a per-layer MDI picture of this step, relative to the log."""
        if self.failed:
            self.dropped_writes += 1
            return False
        has_group = any("group" in r for r in rollouts)
        header = ["#", *(["group"] if has_group else []), *[label for _, label in self.columns]]
        rows = [[r.get("index", pos), *([r.get("group")] if has_group else []), *[r.get(k) for k, _ in self.columns]]
                for pos, r in enumerate(rollouts)]
        parts = [f"### Rollouts ({len(rollouts)})\n", md_table(header, rows), "### Step summary\n"]
        stat_rows = []
        for key, label in self.means:
            vals = [float(v) for v in (r.get(key) for r in rollouts) if v is not None and math.isfinite(float(v))]
            if vals:
                stat_rows.append([label, sum(vals) / len(vals), min(vals), max(vals), len(vals)])
        parts.append(md_table(["metric", "mean", "min", "max", "n"], stat_rows))
        counts = [["rollouts", len(rollouts)],
                  ["rows without image", sum(1 for r in rollouts if not r.get("n_image"))],
                  ["rows without measured queries", sum(1 for r in rollouts if r.get("n_queries") == 0)]]
        counts += [[k, _cell(v)] for k, v in (summary or {}).items()]
        parts.append(md_table(["count / extra", "value"], counts))
        data = {"mdi": _mean(r.get("mdi") for r in rollouts), "balance": _mean(r.get("mdi_balance") for r in rollouts)}
        history = [d for _, d in self.records] + [data]
        parts.append(trend_line([d.get("mdi") for d in history], self.trend_width, "Mean MDI trend:") + "  ")
        parts.append(trend_line([d.get("balance") for d in history], self.trend_width, "Mean balance trend:") + "\n")
        if layer_picture:
            parts.append("### MDI by layer\n")
            parts.append(f"![MDI by layer, step {int(step)}]({quote(Path(layer_picture).as_posix())})\n")
        if maps:
            parts.append("### Attention maps\n")
            for idx, rel in maps:
                rel = Path(rel)
                if rel.is_absolute():
                    rel = Path(os.path.relpath(rel, self.path.parent))
                parts.append(f"![attention map, step {int(step)}, rollout {int(idx)}]({quote(rel.as_posix())})\n")
        return self._write_block(step, epoch, "\n".join(parts), data)
