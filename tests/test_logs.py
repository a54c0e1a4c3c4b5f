"""Live Markdown logs (trl_mdi.diagnostics): safe formatting, the two writers, resume, failures, maps, console.

The files are read back with a small fence-aware reader written here, independently of the library's own
scanner, so a broken fence or a forged marker shows up as a wrong count of headings.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import io
import math
import os
import re
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from trl_mdi import signals
from trl_mdi.diagnostics import (
    AttentionLogWriter,
    LogPathError,
    RolloutLogWriter,
    clean,
    default_log_paths,
    escape_inline,
    fence,
    format_step_summary,
    md_table,
    print_step_summary,
    prompt_text,
    render_attention_map,
    render_segment_maps,
    sparkline,
    trend_line,
)
from trl_mdi.diagnostics.log_file import claim_log_paths
from trl_mdi.diagnostics.maps import display_size
from trl_mdi.diagnostics.writers import summary_label

SPARKS = "▁▂▃▄▅▆▇█"


# --------------------------------------------------------------------------------------------------
# An independent reader: which lines lie outside fenced code blocks, and does every fence close?
# --------------------------------------------------------------------------------------------------
def outside_fences(text: str) -> list[str]:
    """Lines outside fenced code blocks (CommonMark rules, backtick and tilde fences). Fails on an open fence."""
    out, open_fence = [], None
    for line in text.split("\n"):
        if open_fence is None:
            m = re.match(r"^ {0,3}(`{3,}|~{3,})([^`]*)$", line) if line.lstrip(" ").startswith(("```", "~~~")) else None
            if m:
                open_fence = m.group(1)
            else:
                out.append(line)
        elif re.match(r"^ {0,3}" + re.escape(open_fence[0]) + "{" + str(len(open_fence)) + r",}\s*$", line):
            open_fence = None
    assert open_fence is None, "a fenced block never closes: everything after it renders as code"
    return out


def cells(row: str) -> list[str]:
    """GFM table cells of one row: split on pipes not escaped by an odd number of backslashes."""
    inner = row.strip()[1:-1]
    parts, cur, i = [], "", 0
    while i < len(inner):
        c = inner[i]
        if c == "\\" and i + 1 < len(inner):
            cur += inner[i : i + 2]
            i += 2
            continue
        if c == "|":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    return parts + [cur.strip()]


def step_headings(text: str) -> list[int]:
    return [int(m.group(1)) for line in outside_fences(text) if (m := re.match(r"^## Step (\d+)\b", line))]


def read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def make_rollouts(step: int, n: int = 4, completions: list[str] | None = None) -> list[dict]:
    out = []
    for i in range(n):
        mc = float((i + step) % 2)
        fmt = 1.0 if i % 3 else 0.0
        bal = None if i == n - 1 else round(-1 + 0.37 * i + 0.01 * step, 6)
        out.append({
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Q{step}.{i}: color?"}]}],
            "image_sizes": [(56, 48)],
            "completion": completions[i] if completions else f"<think>step {step} rollout {i}</think>Answer: A",
            "rewards": {"mc_idx": mc, "think_format": fmt, "mdi_balance": bal},
            "reward": 4 * mc + fmt + (bal or 0.0),
            "advantage": 0.123456 * (i - 1.5),
            "answer": "A (red)",
            "group": i // 2,
        })
    return out


def attention_row(mdi: float | None, n_image: int = 64) -> dict:
    """One rollout's signals, keyed as trl_mdi.signals.rollout_rows keys them."""
    row = {f"mdi_{seg}": None if mdi is None else mdi * f for seg, f in (("early", 0.5), ("middle", 1.0), ("late", 2.0))}
    row.update(mdi=mdi, mdi_balance=0.5 if mdi else None, aei_text=1.2, aei_image=None if mdi is None else 1.2 / mdi,
               image_mass=0.2, prompt_text_mass=0.5, completion_mass=0.3, special_mass=0.0, image_blind_layers=0,
               n_image=n_image, n_prompt_text=30, n_special=0, n_completion=20, n_queries=20)
    return row


SEGMENTS = ["early", "middle", "late"]


def attention_writer(path, **kwargs) -> AttentionLogWriter:
    return AttentionLogWriter(path, columns=signals.log_columns(SEGMENTS), means=signals.log_means(SEGMENTS), **kwargs)


# --------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------
def test_fence_is_longer_than_any_backtick_run_and_closes():
    for text in ["", "plain", "```", "a ```` b", "`" * 17, "```python\nx\n```\n", "~~~\n````\n"]:
        block = fence(text, "text")
        first = block.split("\n", 1)[0]
        ticks = len(first) - len("text")
        longest = max((len(r) for r in re.findall(r"`+", text)), default=0)
        assert ticks >= 3 and ticks > longest
        assert outside_fences(block + "after\n") == ["after", ""]


def test_clean_removes_controls_normalises_newlines_and_caps():
    text = "a\r\nb\rc\x00\x1b[31md\x07\te\u202ef\x85g\ud800"
    out = clean(text)
    assert out == "a\nb\ncd\tefg?".replace("cd", "c[31md")
    assert "\r" not in out and "\x1b" not in out and "\t" in out
    capped = clean("x" * 1000, 10)
    assert capped == "x" * 10 + "... (990 more chars)"
    assert clean("short", 10) == "short"


def test_escape_inline_and_md_table_cells():
    assert escape_inline("<b>&</b>") == "&lt;b&gt;&amp;&lt;/b&gt;"
    hostile = "a|b\\|c\nd"
    table = md_table(["h|1", "n"], [[hostile, None], ["x", float("nan")], ["y", float("inf")], ["z", 1 / 3]])
    rows = table.strip().split("\n")
    assert all(len(cells(r)) == 2 for r in rows), rows
    assert [cells(r)[1] for r in rows[2:]] == ["—", "nan", "inf", "0.3333"]
    assert "\n" not in escape_inline("x\ny")
    with pytest.raises(ValueError, match="3 cells"):
        md_table(["a", "b"], [[1, 2, 3]])


def test_sparkline_properties():
    vals = [3.0, 1.0, None, 7.0, float("nan"), 5.0, 7.0]
    s = sparkline(vals)
    assert len(s) == len(vals)
    assert s[2] == " " and s[4] == " "
    assert s[1] == "▁" and s[3] == "█" and s[6] == "█"
    assert sparkline([2.5] * 4) == "▄▄▄▄"
    assert sparkline([None, None]) == "  "
    ramp = sparkline(list(range(20)))
    assert list(ramp) == sorted(ramp, key=SPARKS.index) and ramp[0] == "▁" and ramp[-1] == "█"
    line = trend_line(list(range(100)), width=10, label="MDI")
    spark = re.search(r"`(.*)`", line).group(1)
    # The whole run, binned (10 steps per character), not a window of the last 10: the rise from step 0 shows.
    assert len(spark) == 10 and spark[0] == "▁" and spark[-1] == "█" and list(spark) == sorted(spark, key=SPARKS.index)
    assert "min 0 · max 99 · last 99 (100 points, 10 per character)" in line, line
    assert line.endswith("first 10% mean 4.5 → last 10% mean 94.5"), line
    uneven = trend_line([1.0] * 7 + [None] * 3 + [5.0] * 5, width=4)  # bins of 3-4; missing values are skipped
    assert "(15 points, 3-4 per character)" in uneven and "last 5" in uneven, uneven


def test_prompt_text_image_placeholders():
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}, {"type": "image"}]}]
    assert prompt_text(conv, [(56, 48), (10, 20)]) == "system: Be brief.\nuser: [image 56x48] What? [image 10x20]"
    qwen = "<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Color?"
    assert prompt_text(qwen, [Image.new("RGB", (32, 16))]) == "<|im_start|>user\n[image 32x16]Color?"
    assert prompt_text("no placeholder", [(8, 8)]) == "[image 8x8]\nno placeholder"


def test_default_log_paths(tmp_path):
    r, a = default_log_paths(tmp_path, "Qwen/VL run #1")
    assert r == tmp_path / "rollout_results_Qwen_VL_run_1.md"
    assert a == tmp_path / "attention_diagnostics_Qwen_VL_run_1.md"
    r2, _ = default_log_paths(tmp_path)
    assert re.fullmatch(r"rollout_results_\d{8}-\d{6}\.md", r2.name)


# --------------------------------------------------------------------------------------------------
# Rollout log
# --------------------------------------------------------------------------------------------------
def test_rollout_log_round_trip_and_growth(tmp_path):
    path = tmp_path / "logs" / "rollouts.md"
    w = RolloutLogWriter(path, run_name="rt", config={"lr": 1e-5, "reward_weights": [4, 1, 1]},
                         full_rollouts_per_step=2)
    sizes, given = [], {}
    for step in (1, 2, 3):
        rollouts = make_rollouts(step)
        given[step] = rollouts
        assert w.write_step(step, step / 10, rollouts, {"completions/clipped_ratio": 0.25})
        text = read(path)  # read by another handle while the writer is open: flushed
        sizes.append(len(text))
        assert f"## Step {step} " in text
    w.close()
    assert sizes[0] < sizes[1] < sizes[2]
    text = read(path)
    assert text.count("<!-- trl_mdi:header kind=rollout") == 1 and "| lr | 1e-05 |" in text
    assert step_headings(text) == [1, 2, 3]
    blocks = re.split(r"^## Step \d+ ", text, flags=re.M)[1:]
    for step, block in zip((1, 2, 3), blocks):
        rollouts = given[step]
        # Full rollouts: one reward table each; values as written.
        full_tables = re.findall(r"\| reward \| value \|\n\|---\|---:\|\n((?:\|.*\|\n)+)", block)
        assert len(full_tables) == 2
        for r, table in zip(rollouts[:2], full_tables):
            found = {cells(row)[0]: cells(row)[1] for row in table.strip().split("\n")}
            for name, value in r["rewards"].items():
                assert found[name] == "—" if value is None else math.isclose(float(found[name]), value, rel_tol=1e-3)
            assert math.isclose(float(found["**total (weighted)**"]), r["reward"], rel_tol=1e-3)
            assert math.isclose(float(found["advantage"]), r["advantage"], rel_tol=1e-3)
        assert f"[image 56x48] Q{step}.0: color?" in block and "**Gold answer:** A (red)" in block
        # Other rollouts: one row each, columns by header.
        table = block.split("### Other rollouts (2)\n\n", 1)[1].split("\n\n", 1)[0].split("\n")
        header = cells(table[0])
        for r, row in zip(rollouts[2:], table[2:]):
            row = dict(zip(header, cells(row)))
            assert math.isclose(float(row["total"]), r["reward"], rel_tol=1e-3)
            assert float(row["mc_idx"]) == r["rewards"]["mc_idx"]
        summary = dict(cells(row)[:2] for row in block.split("### Step summary\n\n")[1].split("\n\n")[0].split("\n")[2:])
        mean = sum(r["reward"] for r in rollouts) / 4
        assert math.isclose(float(summary["reward (weighted) mean"]), mean, rel_tol=1e-3)
        assert float(summary["accuracy"]) == 0.5 and summary["groups with zero reward spread"] == "0 / 2"
        assert summary["completions/clipped_ratio"] == "0.25"


def test_rollout_groups_from_num_generations(tmp_path):
    """Without a ``group`` key the group is the rollout's block of num_generations (TRL's order), never "—"."""
    rollouts = make_rollouts(1, n=6)
    for r in rollouts:
        del r["group"]
    w = RolloutLogWriter(tmp_path / "g.md", full_rollouts_per_step=2, num_generations=3, colorize=False)
    assert w.write_step(1, 0.0, rollouts)
    text = (tmp_path / "g.md").read_text()
    assert "### Rollout 0 · group 0 ·" in text and "### Rollout 1 · group 0 ·" in text
    table = text.split("### Other rollouts (4)\n\n", 1)[1].split("\n\n", 1)[0].split("\n")
    assert [cells(row)[:2] for row in table[2:]] == [["2", "0"], ["3", "1"], ["4", "1"], ["5", "1"]]
    assert "| groups with zero reward spread | 0 / 2 |" in text


def test_rollout_log_says_how_many_images_a_prompt_had(tmp_path):
    """A mixed or multi-image batch gets an images column and a count in the summary; a one-image batch does not."""
    rollouts = make_rollouts(1, n=6)
    for r, k in zip(rollouts, [2, 2, 0, 0, 1, 3]):
        r["image_sizes"] = [(56, 48)] * k
    w = RolloutLogWriter(tmp_path / "m.md", full_rollouts_per_step=1, colorize=False)
    assert w.write_step(1, 0.0, rollouts)
    text = (tmp_path / "m.md").read_text()
    assert "**Prompt** · 2 image(s)" in text
    table = text.split("### Other rollouts (5)\n\n", 1)[1].split("\n\n", 1)[0].split("\n")
    assert cells(table[0])[:3] == ["#", "group", "images"]
    assert [cells(row)[2] for row in table[2:]] == ["2", "0", "0", "1", "3"]
    assert "| rollouts by images in the prompt | 0 images: 2 · 1 image: 1 · 2 images: 2 · 3 images: 1 |" in text
    w = RolloutLogWriter(tmp_path / "one.md", full_rollouts_per_step=1, colorize=False)
    assert w.write_step(1, 0.0, make_rollouts(1, n=4))
    text = (tmp_path / "one.md").read_text()
    assert "images" not in text.split("### Other rollouts", 1)[1].split("\n\n", 2)[1].split("\n")[0]
    assert "rollouts by images" not in text


def _batch_log(rows: list[dict], completions: list[str]):
    from trl_mdi.diagnostics import BatchLog

    n = len(rows)
    # Rewards and advantages are gathered: this process's rows are the last n of 2n.
    rewards = torch.tensor([[0.0, 0.0]] * n + [[1.0, 0.5], [0.0, float("nan")]][:n])
    return BatchLog(step=1, epoch=0.0, rows=rows, prompts=[f"Q{i}" for i in range(n)], completions=completions,
                    completion_lengths=[7] * n, rewards=rewards, advantages=torch.arange(2 * n, dtype=torch.float32),
                    reward_names=["accuracy", "spread_reward"], reward_weights=[2.0, 1.0])


MC_ROWS = [{"label_idx": 1, "choices": ["red", "blue"]}, {"label_idx": 0, "choices": ["red", "blue"]}]
FREE_ROWS = [{"solution": "\\frac{1}{3}"}, {"question": "no gold at all"}]


def test_task_columns_come_from_the_rows_not_from_multiple_choice(tmp_path):
    """Multiple-choice rows (label_idx + choices) get a gold letter, the parsed letter and the format verdict; rows
    of a math / free-form task (a ``solution`` column, or nothing) get their solution as gold and neither of the
    others, so their log has no parsed and no format column."""
    from trl_mdi.diagnostics import rollout_records
    from trl_mdi.rewards import ThinkFormatReward

    texts = ["<think>x</think>\nAnswer: B", "<think>x</think>\nThe answer is \\boxed{\\frac{1}{3}}"]
    mc = [r["rollout"] for r in rollout_records(_batch_log(MC_ROWS, texts), offset=2, answer_format=ThinkFormatReward())]
    assert [(r["answer"], r["parsed"], r["format_ok"]) for r in mc] == [("B (blue)", "B", True), ("A (red)", None, False)]
    # Final values, numbered globally: rows 2 and 3 of the gathered rewards and advantages, None for a NaN reward.
    assert [r["index"] for r in mc] == [2, 3] and [r["advantage"] for r in mc] == [2.0, 3.0]
    assert mc[0]["reward"] == 2.5 and mc[1]["rewards"] == {"accuracy": 0.0, "spread_reward": None}
    free = [r["rollout"] for r in rollout_records(_batch_log(FREE_ROWS, texts), offset=2,
                                                  answer_format=ThinkFormatReward())]
    assert free[0]["answer"] == "\\frac{1}{3}" and not {"parsed", "format_ok"} & set(free[0])
    assert not {"answer", "parsed", "format_ok"} & set(free[1])
    with pytest.raises(ValueError, match="not in the 4 gathered rewards"):
        rollout_records(_batch_log(MC_ROWS, texts), offset=3)

    for name, rollouts in (("mc", mc), ("free", free)):
        w = RolloutLogWriter(tmp_path / f"{name}.md", full_rollouts_per_step=1, accuracy_rewards=["accuracy"])
        assert w.write_step(1, 0.0, rollouts)
        w.close()
    mc_text, free_text = read(tmp_path / "mc.md"), read(tmp_path / "free.md")
    header = cells(mc_text.split("### Other rollouts (1)\n\n", 1)[1].split("\n", 1)[0])
    assert header[-4:] == ["parsed", "gold", "format", "completion"]
    assert "**Parsed answer:** B · **Gold answer:** B (blue) · **Format:** ✅ asked" in mc_text
    header = cells(free_text.split("### Other rollouts (1)\n\n", 1)[1].split("\n", 1)[0])
    assert header[-2:] == ["gold", "completion"] and "parsed" not in header and "format" not in header
    # the backslash escaped for Markdown (issue 42): it renders as \frac{1}{3}
    assert "**Gold answer:** \\\\frac{1}{3}" in free_text and "Parsed answer" not in free_text
    assert "**Format:**" not in free_text and "clean format" not in free_text
    assert "| accuracy | 0.5 |" in free_text  # right / wrong still comes from the accuracy reward


def test_console_shows_the_accuracy_rewards_or_the_first_reward():
    from trl_mdi.diagnostics import ConsoleSummaryCallback

    default = ConsoleSummaryCallback(False, ["mc_idx", "think_format", "mdi_balance"])
    assert default.keys[:2] == ("reward", "rewards/mc_idx/mean")
    math_run = ConsoleSummaryCallback(False, ["think_format", "accuracy"])
    assert math_run.keys[:2] == ("reward", "rewards/accuracy/mean") and "rewards/mc_idx/mean" not in math_run.keys
    custom = ConsoleSummaryCallback(False, ["my_math_reward", "length_penalty"])
    assert custom.keys[:3] == ("reward", "rewards/my_math_reward/mean", "attention/mdi")


# --------------------------------------------------------------------------------------------------
# Reliance signals (visual_gain, answer_visual_gain, blind_agrees) in the rollout log
# --------------------------------------------------------------------------------------------------
# One step of make_rollouts(1, n=3), one rollout in full: the rollout log of a run without reliance signals, pinned
# byte for byte below its "## Step" line (the line holds the clock). The signals add to it only when computed.
PINNED_STEP = """\
### Rollout 0 · group 0 · reward 3.01 · advantage -0.1852 · ✅

**Prompt** · 1 image(s)

```text
user: [image 56x48] Q1.0: color?
```

**Completion** · 40 chars

```text
<think>step 1 rollout 0</think>Answer: A
```

**Gold answer:** A (red)

| reward | value |
|---|---:|
| mc_idx | 1 |
| think_format | 0 |
| mdi_balance | -0.99 |
| **total (weighted)** | 3.01 |
| advantage | -0.1852 |

### Other rollouts (2)

| # | group | mc_idx | think_format | mdi_balance | total | advantage | correct | length | gold | completion |
|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|
| 1 | 0 | 0 | 1 | -0.62 | 0.38 | -0.06173 | ❌ | 40 | A (red) | &lt;think&gt;step 1 rollout 1&lt;/think&gt;Answer: A |
| 2 | 1 | 1 | 1 | — | 5 | 0.06173 | ✅ | 40 | A (red) | &lt;think&gt;step 1 rollout 2&lt;/think&gt;Answer: A |

### Step summary

| metric | value |
|---|---|
| rollouts | 3 |
| reward (weighted) mean | 2.797 |
| mc_idx mean | 0.6667 |
| think_format mean | 0.6667 |
| mdi_balance mean | -0.805 |
| advantage mean \\|A\\| | 0.1029 |
| accuracy | 0.6667 |
| completion length mean (chars) | 40 |
| completion length min / max (chars) | 40 / 40 |
| groups with zero reward spread | 1 / 2 |

Mean reward trend: `▄` min 2.797 · max 2.797 · last 2.797 (1 point)\x20\x20
Accuracy trend: `▄` min 0.6667 · max 0.6667 · last 0.6667 (1 point)

<!-- trl_mdi:end step=1 {"reward":2.79667,"accuracy":0.666667} -->

"""

# The step summary's reliance rows: one per counterfactual metric signal, in the table's order, then the answer rate.
RELIANCE_SUMMARY = ["visual gain mean (nats per token)", "answer visual gain mean (nats)",
                    "blind agreement (share of answers unchanged without the image)",
                    "answer rate (rollouts with an image and an answer)"]


def with_reliance(rollouts: list[dict], values: list[tuple]) -> list[dict]:
    """The rollouts with (visual_gain, answer_visual_gain, blind_agrees) added, as rollout_records adds them."""
    return [{**r, "visual_gain": v, "answer_visual_gain": a, "blind_agrees": b}
            for r, (v, a, b) in zip(rollouts, values)]


def summary_of(block: str) -> dict[str, str]:
    rows = block.split("### Step summary\n\n", 1)[1].split("\n\n", 1)[0].split("\n")[2:]
    return dict(cells(row)[:2] for row in rows)


def test_rollout_log_without_reliance_signals_is_unchanged(tmp_path):
    """No reliance key on any rollout: the step block is today's, byte for byte (no column, line or summary row)."""
    w = RolloutLogWriter(tmp_path / "p.md", full_rollouts_per_step=1, accuracy_rewards=["mc_idx"],
                         counterfactual="grey")
    assert w.write_step(1, 0.5, make_rollouts(1, n=3))
    w.close()
    text = read(tmp_path / "p.md")
    assert text.split("\n## Step 1 · epoch 0.500 · ", 1)[1].split("\n\n", 1)[1] == PINNED_STEP


def test_rollout_log_shows_reliance_signals_when_computed(tmp_path):
    """Per rollout: vis gain / ans gain / blind columns and a worded line in the full rollouts; per step: the
    blind-agreement rate over the rollouts with a verdict, the mean gains where defined, the answer rate over all
    rollouts, and a blind-agreement trend that survives a resume."""
    path = tmp_path / "rel.md"
    values = {1: [(0.12, 2.31, 0.0), (-0.05, -0.4, 1.0), (0.3, None, None), (0.2, 1.0, 1.0), (None, None, None)],
              2: [(0.1, 3.0, 0.0), (0.1, 2.0, 0.0), (0.1, 1.0, 1.0), (0.1, 1.0, 0.0), (0.1, 1.0, 0.0)]}
    w = RolloutLogWriter(path, full_rollouts_per_step=2, accuracy_rewards=["mc_idx"], counterfactual="grey")
    for step in (1, 2):
        rollouts = with_reliance(make_rollouts(step, n=5), values[step])
        rollouts[4]["image_sizes"] = []  # a text-only prompt: no signal
        assert w.write_step(step, None, rollouts)
    w.close()
    text = read(path)
    assert step_headings(text) == [1, 2]
    block = re.split(r"^## Step \d+ ", text, flags=re.M)[1]
    # The full rollouts say what each number means.
    assert ("**Reliance on the image** (counterfactual: a grey image of the same size): visual gain +0.12 nats per"
            " token · answer visual gain +2.31 nats · blind answer agrees: no (without the image the answer would have"
            " been different)\n") in block
    assert ("visual gain -0.05 nats per token · answer visual gain -0.4 nats · blind answer agrees: yes (the answer"
            " would have been the same without the image)\n") in block
    # The table: one row per other rollout, None as —, blind as yes / no.
    table = block.split("### Other rollouts (3)\n\n", 1)[1].split("\n\n", 1)[0].split("\n")
    header = cells(table[0])
    assert header[-4:] == ["vis gain", "ans gain", "blind", "completion"]
    rows = [dict(zip(header, cells(row))) for row in table[2:]]
    assert [(r["vis gain"], r["ans gain"], r["blind"]) for r in rows] == [
        ("0.3", "—", "—"), ("0.2", "1", "yes"), ("—", "—", "—")]
    summary = summary_of(block)
    assert [k for k in summary if k in RELIANCE_SUMMARY] == RELIANCE_SUMMARY
    gain, answer_gain, blind, answer_rate = (summary[k] for k in RELIANCE_SUMMARY)
    assert float(blind) == pytest.approx(2 / 3, abs=1e-4)  # 2 of the 3 rollouts with a verdict
    assert float(answer_gain) == pytest.approx((2.31 - 0.4 + 1.0) / 3, abs=1e-3)
    assert float(gain) == pytest.approx((0.12 - 0.05 + 0.3 + 0.2) / 4, abs=1e-3)
    assert float(answer_rate) == 0.6  # 3 of all 5 rollouts have an answer visual gain
    assert ("Accuracy trend: `▄` min 0.6 · max 0.6 · last 0.6 (1 point)  \n"
            "Blind agreement trend: `▄` min 0.6667") in block

    # Resume after step 1: the blind-agreement trend is rebuilt from the file's end markers.
    w = RolloutLogWriter(path, full_rollouts_per_step=2, counterfactual="grey").open(resume_from_step=1)
    assert w.records[0][1]["blind_agree"] == pytest.approx(2 / 3, abs=1e-5)
    assert w.write_step(2, None, with_reliance(make_rollouts(2, n=5), values[2]))
    w.close()
    last = re.split(r"^## Step \d+ ", read(path), flags=re.M)[-1]
    assert float(summary_of(last)[RELIANCE_SUMMARY[2]]) == 0.2 and float(summary_of(last)[RELIANCE_SUMMARY[3]]) == 1
    assert "Blind agreement trend: `█▁` min 0.2 · max 0.6667 · last 0.2 (2 points)" in last


def test_reliance_line_for_rollouts_without_an_answer_or_an_image(tmp_path):
    """None values are explained, not printed as numbers; the counterfactual is named as configured (or not at all)."""
    rollouts = with_reliance(make_rollouts(1, n=2), [(0.25, None, None), (None, None, None)])
    rollouts[0]["answer_image_attention"] = 0.0312
    rollouts[1]["image_sizes"] = []
    w = RolloutLogWriter(tmp_path / "r.md", full_rollouts_per_step=2, counterfactual="none")
    assert w.write_step(1, None, rollouts)
    text = read(tmp_path / "r.md")
    assert ("**Reliance on the image** (counterfactual: the prompt without its image): visual gain +0.25 nats per"
            " token · answer visual gain — (no answer line) · blind answer agrees: — (no answer letter to compare) ·"
            " image attention at the answer letter 0.0312\n") in text
    assert ("**Reliance on the image** (counterfactual: the prompt without its image): — (no image in the prompt)\n"
            in text)
    summary = summary_of(text)
    assert summary[RELIANCE_SUMMARY[2]] == "—" and summary[RELIANCE_SUMMARY[1]] == "—"
    assert summary[RELIANCE_SUMMARY[0]] == "0.25"  # the one defined gain; the undefined one is no 0
    assert summary[RELIANCE_SUMMARY[3]] == "0" and "Blind agreement trend: (no data yet)" in text
    # answer_image_attention has no column but is a metric: its mean is a summary row (0.0312 of the one rollout)
    assert summary_label(signals.signal_of("answer_image_attention")) in summary
    from trl_mdi.counterfactual import counterfactual_kinds
    from trl_mdi.diagnostics.writers import COUNTERFACTUALS

    assert set(COUNTERFACTUALS) == set(counterfactual_kinds())  # every configurable I' is named in words
    w = RolloutLogWriter(tmp_path / "plain.md", full_rollouts_per_step=1)  # a writer that was not told I'
    assert w.write_step(1, None, rollouts[:1])
    assert "**Reliance on the image:** visual gain +0.25 nats per token" in read(tmp_path / "plain.md")


def test_reliance_signals_go_to_the_rollout_record_not_the_attention_row(tmp_path):
    """rollout_records puts the reliance signals (NaN -> None) on the rollout, the probe signals on the attention row
    and the reward-only group scores on neither, and gives no attention row when the batch has reliance signals only
    (attention metrics off). The attention log of a batch with reliance signals is the same as without them."""
    from trl_mdi.diagnostics import rollout_records
    from trl_mdi.rewards import ThinkFormatReward

    texts = ["<think>x</think>\nAnswer: B", "<think>x</think>\nno answer"]
    nan = float("nan")
    reliance = {"visual_gain": torch.tensor([0.5, -0.1]), "answer_visual_gain": torch.tensor([2.0, nan]),
                "blind_agrees": torch.tensor([0.0, nan]), "answer_image_attention": torch.tensor([0.04, nan]),
                "answer_visual_gain_group_score": torch.tensor([0.0, nan])}
    attention = {k: torch.tensor([float("nan") if v is None else float(v) for v in (attention_row(2.0)[k],
                                                                                    attention_row(3.0)[k])])
                 for k in attention_row(2.0)}
    attention["mdi_group_score"] = torch.tensor([1.0, -1.0])
    base = _batch_log(MC_ROWS, texts)

    def records(table):
        return rollout_records(dataclasses.replace(base, signals=table), offset=2, answer_format=ThinkFormatReward())

    only_reliance, both, only_attention = records(reliance), records({**attention, **reliance}), records(attention)
    assert [r["attention"] for r in only_reliance] == [None, None]
    assert [r["attention"] for r in both] == [r["attention"] for r in only_attention]
    assert set(both[0]["attention"]) == {*attention_row(2.0), "index"}  # the probe signals, no group score
    for recs in (only_reliance, both):
        assert [{k: r["rollout"][k] for k in signals.reliance_names() if k in r["rollout"]} for r in recs] == [
            {"visual_gain": 0.5, "answer_visual_gain": 2.0, "blind_agrees": 0.0,
             "answer_image_attention": pytest.approx(0.04)},
            {"visual_gain": pytest.approx(-0.1), "answer_visual_gain": None, "blind_agrees": None,
             "answer_image_attention": None}]
        assert not {"answer_visual_gain_group_score", "mdi_group_score"} & set(recs[0]["rollout"])
    assert not set(signals.counterfactual_fields()) & set(only_attention[0]["rollout"])
    assert [r["rollout"] for r in records(None)] == [r["rollout"] for r in only_attention]
    for name, recs in (("both", both), ("attention", only_attention)):
        w = attention_writer(tmp_path / name / "att.md", run_name="r")
        assert w.write_step(1, None, [{"index": r["rollout"]["index"], **r["attention"]} for r in recs])
        w.close()
    clock = functools.partial(re.sub, r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}( \(\+[\d:]+\))?", "")
    assert clock(read(tmp_path / "both" / "att.md")) == clock(read(tmp_path / "attention" / "att.md"))


def test_a_counterfactual_signal_added_to_the_table_reaches_the_rollout_log(tmp_path, monkeypatch):
    """The rollout log reads the signal table: a counterfactual entry added to ``SIGNALS`` (a number with a column,
    a 0/1 flag with words) gets its column (the flag as yes / no), its phrase in the reliance line, its summary row
    (mean where finite; the flag's rate) and, for the flag, a trend rebuilt on resume; rollout_records puts it on
    the rollout, not the attention row."""
    from trl_mdi.diagnostics import rollout_records

    gain = signals.Signal("peak_gain", "largest g_t", lambda x: None, source=signals.COUNTERFACTUAL, metric=True,
                          log="peak")
    flag = signals.Signal("peak_late", "the largest g_t is in the completion's second half", lambda x: None,
                          source=signals.COUNTERFACTUAL, metric=True, flag=True, log="late?",
                          label="late peak (share of rollouts)",
                          words=lambda v: "peak late: —" if v is None else f"peak late: {'yes' if v else 'no'}")
    monkeypatch.setattr(signals, "SIGNALS", (*signals.SIGNALS, gain, flag))
    assert [name for name, _ in signals.rollout_log_columns()][-2:] == ["peak_gain", "peak_late"]
    values = [(1.5, 1.0), (None, None), (0.5, 0.0), (-1.0, 1.0)]
    rollouts = [{**r, "visual_gain": 0.1, "peak_gain": g, "peak_late": f}
                for r, (g, f) in zip(make_rollouts(1, n=4), values)]
    path = tmp_path / "peak.md"
    w = RolloutLogWriter(path, full_rollouts_per_step=1, accuracy_rewards=["mc_idx"], counterfactual="grey")
    assert w.write_step(1, None, rollouts)
    w.close()
    block = re.split(r"^## Step \d+ ", read(path), flags=re.M)[1]
    assert ("**Reliance on the image** (counterfactual: a grey image of the same size): visual gain +0.1 nats per token"
            " · peak late: yes\n") in block  # the number without words has no phrase
    table = block.split("### Other rollouts (3)\n\n", 1)[1].split("\n\n", 1)[0].split("\n")
    header = cells(table[0])
    assert header[-4:] == ["vis gain", "peak", "late?", "completion"]
    assert [(r["peak"], r["late?"]) for r in (dict(zip(header, cells(row))) for row in table[2:])] == [
        ("—", "—"), ("0.5", "no"), ("-1", "yes")]
    summary = summary_of(block)
    assert float(summary["peak mean"]) == pytest.approx((1.5 + 0.5 - 1.0) / 3, abs=1e-4)
    assert float(summary["late peak (share of rollouts)"]) == pytest.approx(2 / 3, abs=1e-4)
    assert "Late peak trend: `▄` min 0.6667" in block
    w = RolloutLogWriter(path, counterfactual="grey").open(resume_from_step=1)
    assert w.records[0][1]["peak_late"] == pytest.approx(2 / 3, abs=1e-5)
    w.close()

    table = {"visual_gain": torch.tensor([0.5, -0.1]), "peak_gain": torch.tensor([2.0, float("nan")]),
             "peak_late": torch.tensor([1.0, 0.0])}
    recs = rollout_records(dataclasses.replace(_batch_log(MC_ROWS, ["a", "b"]), signals=table), offset=2)
    assert [(r["rollout"]["peak_gain"], r["rollout"]["peak_late"], r["attention"]) for r in recs] == [
        (2.0, 1.0, None), (None, 0.0, None)]


def test_the_rollout_logs_reliance_columns_and_rows_come_from_the_table():
    assert signals.rollout_log_columns() == [("visual_gain", "vis gain"), ("answer_visual_gain", "ans gain"),
                                             ("blind_agrees", "blind")]
    assert summary_label(signals.signal_of("blind_agrees")) == "blind agreement (share of answers unchanged without " \
                                                                "the image)"


def test_the_step_summary_reads_the_batch_metrics_it_is_given(tmp_path):
    """With the batch's metrics (the trainer's reliance/*), the reliance rows are those numbers, not a second
    computation over the rollouts."""
    rollouts = with_reliance(make_rollouts(1, n=2), [(0.25, 1.0, 1.0), (0.5, None, None)])
    metrics = {"reliance/visual_gain": 9.5, "reliance/answer_visual_gain": -7.0, "reliance/blind_agree_rate": 0.125,
               "reliance/answer_rate": 0.75}
    w = RolloutLogWriter(tmp_path / "m.md", full_rollouts_per_step=1, counterfactual="grey")
    assert w.write_step(1, None, rollouts, metrics=metrics)
    w.close()
    summary = summary_of(re.split(r"^## Step \d+ ", read(tmp_path / "m.md"), flags=re.M)[1])
    assert [float(summary[k]) for k in RELIANCE_SUMMARY] == [9.5, -7.0, 0.125, 0.75]


def test_console_shows_the_blind_agreement_rate_when_logged(capsys):
    from types import SimpleNamespace

    from trl_mdi.diagnostics import ConsoleSummaryCallback

    callback = ConsoleSummaryCallback(False, ["mc_idx"])
    assert "reliance/blind_agree_rate" in callback.keys
    state = SimpleNamespace(is_world_process_zero=True, global_step=3)
    callback.on_log(None, state, None, logs={"loss": 0.1, "reward": 1.0, "reliance/blind_agree_rate": 0.25})
    assert re.search(r"^  reliance/blind_agree_rate +0\.25$", capsys.readouterr().out, re.M)
    callback.on_log(None, state, None, logs={"loss": 0.1, "reward": 1.0})
    assert "reliance" not in capsys.readouterr().out


HOSTILE = [
    "``` not closed\n## Step 99\n<script>alert(1)</script>",
    "`````` six\n``````\n````````````````",
    "~~~\nstill text\n<!-- trl_mdi:end step=1 {} -->\n## Step 42 fake",
    "ctrl\x00\x01\x1b[2J\x7f chars\r\nCRLF\rCR\u2028LS | pipe \\| a|b",
    "x" * 100_000,
]


def test_hostile_completions_stay_valid_markdown(tmp_path):
    path = tmp_path / "hostile.md"
    w = RolloutLogWriter(path, run_name="x|`<b>`", preview_chars=500, full_rollouts_per_step=len(HOSTILE))
    rollouts = make_rollouts(1, n=len(HOSTILE), completions=HOSTILE)
    rollouts[0]["answer"] = "A|B\n## Step 77 <i>"
    rollouts[1]["prompt"] = "```\n## Step 55\n" + "`" * 9
    w.write_step(1, None, rollouts, {"note | with pipe": "<b>x</b>\nline2"})
    w = RolloutLogWriter(path.with_name("hostile_rows.md"), full_rollouts_per_step=0)
    w.write_step(1, None, make_rollouts(1, n=len(HOSTILE), completions=HOSTILE), {})
    for p in (path, path.with_name("hostile_rows.md")):
        raw = read(p)
        outside = outside_fences(raw)  # asserts every fence closes
        assert step_headings(raw) == [1]
        headings = [line for line in outside if line.startswith("#")]
        assert not any(fake in h for h in headings for fake in ("Step 99", "Step 42", "Step 55", "Step 77"))
        assert "<script>" not in "\n".join(outside) and "<i>" not in "\n".join(outside)
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", raw) and "\r" not in raw
        assert len(raw) < 20_000 and "more chars)" in raw  # the 100 kB completion is capped
        for table in re.findall(r"((?:^\|.*\|\n)+)", "\n".join(outside) + "\n", flags=re.M):
            rows = table.strip().split("\n")
            assert len({len(cells(r)) for r in rows}) == 1, rows  # pipes in cells escaped
    assert "`" * 17 + "text" in read(path)  # the 16-backtick run got a 17-backtick fence


def test_hostile_log_parses_as_intended_with_a_commonmark_parser(tmp_path):
    # markdown-it-py (a dependency of rich): a real CommonMark + GFM-table parser as a second opinion.
    from markdown_it import MarkdownIt

    path = tmp_path / "hostile.md"
    w = RolloutLogWriter(path, preview_chars=300, full_rollouts_per_step=3)
    rollouts = make_rollouts(1, n=len(HOSTILE), completions=HOSTILE)
    rollouts[4]["answer"] = "<img src=x onerror=alert(1)> | `x"
    w.write_step(1, None, rollouts)
    tokens = MarkdownIt("commonmark").enable("table").parse(read(path))
    inline = [t for tok in tokens if tok.children for t in tok.children]
    h2 = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open" and t.tag == "h2"]
    assert len(h2) == 1 and h2[0].startswith("Step 1 ")
    fences = [t for t in tokens if t.type == "fence"]
    assert len(fences) == 2 * 3 and all(t.info == "text" for t in fences)  # prompt + completion per full rollout
    assert clean(HOSTILE[1], 300) + "\n" == fences[3].content  # the completion comes back verbatim
    html = [t.content.strip() for t in tokens + inline if t.type in ("html_block", "html_inline")]
    assert html and all(h.startswith("<!-- trl_mdi:") or h == "<br>" for h in html), html
    rows = [t for t in tokens if t.type == "tr_open"]
    assert len(rows) == (1 + 5) * 3 + (1 + 2) + (1 + 10)  # 3 reward tables, other rollouts, summary


# --------------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------------
def test_resume_marks_later_steps_undone_and_appends(tmp_path):
    path = tmp_path / "r.md"
    w = RolloutLogWriter(path, run_name="res", full_rollouts_per_step=1)
    for step in range(1, 6):
        # A completion that imitates the markers must not confuse the resume scan.
        w.write_step(step, None, make_rollouts(step, completions=["## Step 9\n<!-- trl_mdi:end step=9 {} -->"] * 4))
    w.close()
    before = read(path)
    assert step_headings(before) == [1, 2, 3, 4, 5]

    w = RolloutLogWriter(path, run_name="res", full_rollouts_per_step=1).open(resume_from_step=3)
    assert [s for s, _ in w.records] == [1, 2, 3]
    for step in (4, 5):
        w.write_step(step, None, make_rollouts(step))
    w.close()
    text = read(path)
    assert text.count("<!-- trl_mdi:header kind=rollout") == 1 and text.count("# Rollout log") == 1
    assert step_headings(text) == [1, 2, 3, 4, 5]
    outside = outside_fences(text)
    marker = next(i for i, line in enumerate(outside) if "**Resumed at step 3**" in line)
    step3 = outside.index(next(line for line in outside if line.startswith("## Step 3 ")))
    step4 = outside.index(next(line for line in outside if line.startswith("## Step 4 ")))
    assert step3 < marker < step4
    assert "2 step block(s) written after it" in outside[marker] and "steps 4–5" in outside[marker]
    assert "were undone" in outside[marker]
    assert text.startswith(before[: before.index("## Step 4 ")])  # steps 1-3 kept byte for byte
    # Steps 4-5 of the first run are kept, before the note, under an "Undone" section whose headings no longer
    # read as steps (issue 38: logs are never destroyed).
    undone = next(i for i, line in enumerate(outside) if "**Undone by the resume from step 3**" in line)
    assert step3 < undone < marker and "steps 4–5" in outside[undone]
    assert [line.split(" · ")[0] for line in outside[undone:marker] if line.startswith("### Undone step")] == [
        "### Undone step 4", "### Undone step 5"]
    old4 = before[before.index("## Step 4 "):].split("\n", 1)[1]
    assert old4.split("<!-- trl_mdi:end")[0] in text  # the undone step's body, byte for byte
    assert "<details><summary>Undone: steps 4–5</summary>" in text
    # A second resume from step 3 undoes the second run's steps 4-5 too, and still counts each step once.
    w = RolloutLogWriter(path, run_name="res", full_rollouts_per_step=1).open(resume_from_step=3)
    assert [s for s, _ in w.records] == [1, 2, 3]
    w.write_step(4, None, make_rollouts(4))
    w.close()
    text = read(path)
    assert step_headings(text) == [1, 2, 3, 4] and text.count("### Undone step 4 ") == 2


def test_resume_cuts_incomplete_block_and_refuses_foreign_file(tmp_path):
    path = tmp_path / "r.md"
    w = RolloutLogWriter(path, full_rollouts_per_step=4)
    for step in (1, 2, 3):
        w.write_step(step, None, make_rollouts(step, completions=["````\nunclosed"] * 4))
    w.close()
    text = read(path)
    cut = text.index("````\nunclosed", text.index("## Step 3 ")) + 8  # crash mid-step 3, inside a fence
    path.write_text(text[:cut], encoding="utf-8")
    w = RolloutLogWriter(path).open(resume_from_step=3)
    w.write_step(3, None, make_rollouts(3))
    w.close()
    text = read(path)
    assert step_headings(text) == [1, 2, 3]  # also asserts every fence closes
    assert "left incomplete (step 3)" in text

    foreign = tmp_path / "notes.md"
    foreign.write_text("# my notes\n", encoding="utf-8")
    with pytest.raises(LogPathError, match="not a trl_mdi log"):
        RolloutLogWriter(foreign).open(resume_from_step=1)
    assert read(foreign) == "# my notes\n"
    with pytest.raises(LogPathError, match="'rollout' log"):
        attention_writer(path).open(resume_from_step=1)


def test_a_fresh_run_never_touches_another_runs_log(tmp_path):
    """Three fresh runs at one path (a reused run name): three files, each run's log whole (before: each run moved the
    previous file to r.md.bak, overwriting the one before, so only two runs' logs were left)."""
    path = tmp_path / "r.md"
    texts = []
    for run in range(3):
        w = RolloutLogWriter(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            w.write_step(1, None, make_rollouts(1))
        w.close()
        texts.append(read(w.path))
        assert w.path.name == ["r.md", "r-2.md", "r-3.md"][run]
        assert [str(c.message) for c in caught if "another run" in str(c.message)] == (
            [] if run == 0 else [f"trl_mdi: {path} already holds another run's log (kept as it is); this run's log "
                                 f"is {w.path}"])
    assert [read(tmp_path / n) for n in ("r.md", "r-2.md", "r-3.md")] == texts
    assert "`r.md` already held another run's log" in texts[2] and not list(tmp_path.glob("*.bak"))
    assert [p.name for p in claim_log_paths([tmp_path / "r.md", tmp_path / "a.md"])] == ["r-4.md", "a-4.md"]


def test_older_step_is_refused(tmp_path):
    w = RolloutLogWriter(tmp_path / "r.md")
    assert w.write_step(5, None, make_rollouts(5))
    with pytest.warns(RuntimeWarning, match="step 4 comes after step 5"):
        assert not w.write_step(4, None, make_rollouts(4))
    assert w.write_step(5, None, make_rollouts(5))  # a second generation batch of step 5
    w.close()
    text = read(tmp_path / "r.md")
    assert step_headings(text) == [5, 5] and "## Step 5 (continued, batch 2)" in text


# --------------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------------
def test_bad_path_fails_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LogPathError) as e:
        RolloutLogWriter(blocker / "logs" / "r.md")
    assert str(blocker / "logs" / "r.md") in str(e.value) and "is a file, not a directory" in str(e.value)
    with pytest.raises(LogPathError, match="it is a directory"):
        attention_writer(tmp_path)
    assert not (tmp_path / "ok" / "r.md").exists()
    RolloutLogWriter(tmp_path / "ok" / "r.md")  # parents created, file not yet
    assert (tmp_path / "ok").is_dir() and not (tmp_path / "ok" / "r.md").exists()


def test_permission_denied_fails_at_construction(tmp_path, monkeypatch):
    real_open = open

    def deny(file, mode="r", *args, **kwargs):
        if str(file).endswith("denied.md") and "a" in mode:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(LogPathError, match="denied.md: Permission denied"):
        RolloutLogWriter(tmp_path / "denied.md")


def test_write_failure_warns_once_and_training_continues(tmp_path, monkeypatch):
    path = tmp_path / "a.md"
    w = attention_writer(path)
    assert w.write_step(1, None, [attention_row(2.0)])
    size = path.stat().st_size

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("trl_mdi.diagnostics.log_file.os.fsync", full_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [w.write_step(s, None, [attention_row(2.0)]) for s in (2, 3, 4)]
    assert results == [False, False, False] and w.failed and w.dropped_writes == 3
    assert len(caught) == 1 and "No space left on device" in str(caught[0].message) and str(path) in str(caught[0].message)
    monkeypatch.undo()
    w.close()
    # The failed step reached the page cache before fsync failed; later steps were never written.
    assert step_headings(read(path)) == [1, 2] and path.stat().st_size > size


def test_write_after_close_is_dropped_not_reopened(tmp_path):
    path = tmp_path / "r.md"
    w = RolloutLogWriter(path)
    w.write_step(1, None, make_rollouts(1))
    w.close()
    before = read(path)
    with pytest.warns(RuntimeWarning, match="the log was closed"):
        assert not w.write_step(2, None, make_rollouts(2))
    assert read(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["r.md"]


# --------------------------------------------------------------------------------------------------
# Attention log
# --------------------------------------------------------------------------------------------------
def test_attention_log_rows_summary_trend_maps_and_resume(tmp_path):
    path = tmp_path / "logs" / "att.md"
    w = attention_writer(path, run_name="att")
    mdis = {1: 1.0, 2: 2.0, 3: 4.0, 4: 100.0, 5: 100.0}
    for step in range(1, 6):
        rows = [attention_row(mdis[step]), attention_row(None, n_image=0)]
        rows[0]["group"] = rows[1]["group"] = 0
        png, rel = w.map_path(step, 0)
        render_attention_map(Image.new("RGB", (32, 32)), np.arange(4.0), (2, 2), png)
        w.write_step(step, None, rows, {"attention/zero_image_rows": 1}, maps=[(0, rel)])
    w.close()
    text = read(path)
    assert step_headings(text) == [1, 2, 3, 4, 5]
    header = next(line for line in outside_fences(text) if line.startswith("| # |"))
    assert cells(header)[:6] == ["#", "group", "MDI early", "MDI middle", "MDI late", "MDI all"]
    assert "| rows without image | 1 |" in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(links) == 5 and all((path.parent / link).is_file() for link in links)

    w = attention_writer(path, run_name="att").open(resume_from_step=3)
    assert [d["mdi"] for _, d in w.records] == [1.0, 2.0, 4.0]  # trend restored from the file
    w.write_step(4, None, [attention_row(8.0)])
    w.close()
    text = read(path)
    assert step_headings(text) == [1, 2, 3, 4, 5][:4]
    last_trend = re.findall(r"Mean MDI trend: `(.*)` min 1 · max 8 · last 8 \(4 points\)", text)
    assert last_trend == ["▁▂▄█"]


# --------------------------------------------------------------------------------------------------
# Attention maps
# --------------------------------------------------------------------------------------------------
def test_attention_map_png_size_and_heat(tmp_path):
    image = Image.new("RGB", (56, 40), (128, 128, 128))
    mass = torch.zeros(4 * 6)
    mass[0] = 1.0  # the top-left token gets all the attention
    out = render_attention_map(image, mass, (4, 6), tmp_path / "m" / "map.png", legend=False, resample="nearest")
    png = Image.open(out)
    assert png.format == "PNG" and png.size == display_size((56, 40)) == (314, 224)
    arr = np.asarray(png.convert("RGB")).astype(int)
    hot, cold = arr[5, 5], arr[-5, -5]  # inside the top-left cell / the bottom-right cell
    assert hot[0] > cold[0] + 60 and hot[1] > cold[1] + 60  # yellow vs purple (viridis ends)
    assert (arr[-5, -5] == arr[-30, -60]).all()  # equal mass, equal colour

    with_legend = Image.open(render_attention_map(image, mass.numpy(), (4, 6), tmp_path / "l.png", title="step 1"))
    assert with_legend.size == (314, 224 + 2 * 18)
    with pytest.raises(ValueError, match="24 values but the token grid 5x5 has 25"):
        render_attention_map(image, mass, (5, 5), tmp_path / "bad.png")
    with pytest.raises(ValueError, match="1-D"):
        render_attention_map(image, mass.reshape(4, 6), (4, 6), tmp_path / "bad.png")


def test_segment_maps_side_by_side(tmp_path):
    image = Image.new("RGB", (32, 32), (255, 255, 255))
    masses = {"early": torch.tensor([1.0, 0, 0, 0]), "middle": torch.tensor([0, 0, 0, 1.0]), "late": torch.ones(4)}
    out = Image.open(render_segment_maps(image, masses, (2, 2), tmp_path / "seg.png", legend=False, gap=4))
    w, h = display_size((32, 32), 160, 320)
    assert out.size == (3 * w + 2 * 4, h + 18)
    arr = np.asarray(out.convert("RGB")).astype(int)
    early_tl, middle_tl = arr[18 + 10, 10], arr[18 + 10, w + 4 + 10]
    assert abs(early_tl - middle_tl).sum() > 100  # top-left hot in "early", cold in "middle"


def test_image_maps_one_panel_row_per_image_on_one_scale(tmp_path):
    from trl_mdi.diagnostics import render_image_maps, split_per_image

    square, wide = Image.new("RGB", (32, 32), (255, 255, 255)), Image.new("RGB", (64, 32), (255, 255, 255))
    row_mass = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0]])  # one layer: 4 tokens (2x2), then 6 (2x3)
    first, second = split_per_image(row_mass, [(2, 2), (2, 3)])
    assert first.shape == (1, 4) and second.shape == (1, 6)
    with pytest.raises(ValueError, match="10 image tokens but its images' token grids"):
        split_per_image(row_mass, [(2, 2), (2, 2)])
    masses = [{"early": first[0], "late": first[0]}, {"early": second[0], "late": second[0]}]
    out = Image.open(render_image_maps([square, wide], masses, [(2, 2), (2, 3)], tmp_path / "two.png", title="t",
                                       captions=["image 1 of 2 · 100%", "image 2 of 2 · 0%"], legend=True, gap=4))
    (w1, h1), (w2, h2) = display_size((32, 32), 160, 320), display_size((64, 32), 160, 320)
    # title, then per image: caption + segment captions + panels; then one legend for every panel.
    assert out.size == (max(2 * w1, 2 * w2) + 4, 18 + (18 + 18 + h1) + (18 + 18 + h2) + 18)
    arr = np.asarray(out.convert("RGB")).astype(int)
    hot = arr[18 + 36 + 5, 5]  # first image, early panel, top-left token: the only mass of the row
    cold = arr[18 + 36 + h1 + 36 + 5, 5]  # second image, top-left token: zero, on the shared scale
    assert hot[0] > cold[0] + 60 and hot[1] > cold[1] + 60  # yellow vs purple
    with pytest.raises(ValueError, match="one caption per image"):
        render_image_maps([square], masses[:1], [(2, 2)], tmp_path / "x.png", captions=["a", "b"])
    with pytest.raises(ValueError, match="one mass dict and one grid per image"):
        render_image_maps([square, wide], masses[:1], [(2, 2)], tmp_path / "x.png")


# --------------------------------------------------------------------------------------------------
# Console
# --------------------------------------------------------------------------------------------------
class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_plain_without_tty_or_with_no_color(monkeypatch):
    metrics = {"reward": 1.5, "attention/mdi": 4.25, "missing": None}
    monkeypatch.delenv("NO_COLOR", raising=False)
    tty = FakeTTY()
    print_step_summary(7, metrics, file=tty)
    assert "\x1b[" in tty.getvalue() and "4.25" in tty.getvalue()  # colour on a terminal

    pipe = io.StringIO()  # not a TTY
    print_step_summary(7, metrics, file=pipe)
    assert "\x1b[" not in pipe.getvalue() and pipe.getvalue().startswith("step 7\n")
    assert isinstance(format_step_summary(7, metrics, colorize=False, file=tty), str)

    monkeypatch.setenv("NO_COLOR", "1")
    tty = FakeTTY()
    print_step_summary(7, metrics, file=tty)
    assert "\x1b[" not in tty.getvalue() and "attention/mdi 4.25" in tty.getvalue() and "missing       —" in tty.getvalue()


def test_diagnostics_library_side_imports_no_trainer():
    """The writers, maps, plots and console load without TRL or transformers (the callbacks load on first use)."""
    code = ("import sys, trl_mdi.diagnostics.writers, trl_mdi.diagnostics.maps, trl_mdi.diagnostics.plots; "
            "print(any(m == 'trl' or m.startswith(('trl.', 'transformers')) for m in sys.modules))")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "False"


def test_image_evidence_marks_the_tokens_the_image_made_likeliest(tmp_path):
    """issue 30 item 5: the full rollout shows 'the shape is **red**' for a rollout whose colour word came from the
    image, and nothing marked for one that guessed. The marks against a loop over the tokens: the top 3 gains that
    reach 1 nat, in completion order, on the tiny tokenizer's real token texts."""
    import torch

    from fixtures.tiny import tokenizer as tiny_tokenizer
    from trl_mdi.diagnostics.batch_log import image_evidence
    from trl_mdi.diagnostics.writers import image_evidence_line

    tok = tiny_tokenizer.build_tokenizer("qwen2_5_vl", tiny_tokenizer.official_chat_template("qwen2_5_vl"), 8192)
    look, guess = "<think> the shape is red</think>\nAnswer: A", "<think> a tomato is red</think>\nAnswer: A"
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in (look, guess)]
    width = max(map(len, ids))
    completion = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    texts = [tok.decode([t]) for t in ids[0]]
    red = max(i for i, t in enumerate(texts) if "red" in t)
    gains = torch.full((2, width), 0.001)
    gains[0, red], gains[0, 0] = 4.41, 1.5  # the colour word read off the image, and one weaker mark
    gains[0, 1] = 0.999  # below the threshold: not marked
    gains[1, : len(ids[1])] = torch.linspace(-0.02, 0.02, len(ids[1]))
    look_ev, guess_ev = image_evidence(gains, completion, mask, tok, rows=2)
    expected = sorted(t for t in sorted(range(len(ids[0])), key=lambda t: -float(gains[0, t]))[:3]
                      if float(gains[0, t]) >= 1.0)
    assert look_ev["marked"] == expected == sorted([0, red]) and guess_ev["marked"] == []
    assert "".join(look_ev["tokens"]) == tok.decode(ids[0])
    line = image_evidence_line(look_ev)
    assert "**red**" in line and line.endswith("+4.41") and "**Image evidence** (tokens at least 1 nat" in line
    assert image_evidence_line(guess_ev).startswith("**Image evidence:** none")
    assert image_evidence(gains, completion, mask, tok, rows=1)[1] is None  # only the fully printed rollouts


def test_skipped_rollouts_have_no_reward_and_are_counted_not_averaged_as_zero(tmp_path):
    """Issue 38: a rollout left out of the update (an unreadable image; every reward NaN) has no weighted total
    (TRL's nansum would make it 0) and the step summary counts it as skipped, outside the means."""
    from trl_mdi.diagnostics import BatchLog, rollout_records

    nan = float("nan")
    log = BatchLog(step=1, epoch=0.0, rows=[{}, {}], prompts=["Q0", "Q1"], completions=["a", "b"],
                   completion_lengths=[1, 1], rewards=torch.tensor([[nan, nan], [1.0, 0.5]]),
                   advantages=torch.zeros(2), reward_names=["accuracy", "spread_reward"],
                   reward_weights=[2.0, 1.0], skipped=torch.tensor([True, False]))
    records = [r["rollout"] for r in rollout_records(log)]
    assert records[0]["reward"] is None and records[0]["skipped"] == "unreadable image"
    assert records[1]["reward"] == 2.5 and "skipped" not in records[1]
    w = RolloutLogWriter(tmp_path / "r.md", full_rollouts_per_step=2, colorize=False)
    assert w.write_step(1, 0.0, records)
    text = (tmp_path / "r.md").read_text()
    assert "### Rollout 0 · reward — · advantage 0 · skipped (unreadable image)" in text, text
    summary = text.split("### Step summary", 1)[1]
    assert "| skipped (unreadable image: out of the update and of these means) | 1 |" in summary
    assert "| reward (weighted) mean | 2.5 |" in summary, summary
