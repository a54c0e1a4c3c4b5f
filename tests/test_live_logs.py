"""The live Markdown logs as the trainer writes them: format, values, hostile completions, resume, growth."""

import functools
import os
import re
from pathlib import Path

import pytest
import torch
from test_trainer import make_args, spread_reward
from transformers import AutoProcessor, TrainerCallback

from trl_mdi import signals as S
from trl_mdi.diagnostics import LogPathError
from trl_mdi.diagnostics.writers import summary_label
from trl_mdi.trainer import MDIGRPOTrainer

STEP_HEADER = re.compile(r"^## Step (\d+)\b", re.M)


def _logs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "logs" / "rollouts.md", tmp_path / "logs" / "attention.md"


def _outside_fences(text: str) -> str:
    """The text with fenced code blocks removed (CommonMark: a fence closes with at least as many backticks)."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^(`{3,})", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.strip().startswith(fence) and set(line.strip()) == {"`"}:
            fence = None
        elif fence is None:
            out.append(line)
    assert fence is None, "a code fence was left open"
    return "\n".join(out)


class SizeWatcher(TrainerCallback):
    """Reads the log file during training, after every optimizer step."""

    def __init__(self, path: Path):
        self.path, self.sizes = path, []

    def on_step_end(self, args, state, control, **kwargs):
        self.sizes.append(self.path.stat().st_size if self.path.exists() else 0)


@pytest.fixture(scope="module")
def model_dir(tiny_vlm_dir):
    return tiny_vlm_dir("qwen2_5_vl")


class Recorded:
    """Wraps a reward and records every value it returns, in rollout order."""

    def __init__(self, fn):
        self.fn, self.values = fn, []
        functools.update_wrapper(self, fn)  # the wrapped signature: the trainer reads which signals a reward takes

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.values.extend(out)
        return out


def test_logs_hold_every_step_and_the_rewards_the_trainer_computed(model_dir, grpo_train_dataset, tmp_path):
    from trl_mdi.rewards import mc_idx, mdi_balance

    rollout_log, attention_log = _logs(tmp_path)
    recorded = [Recorded(mc_idx), Recorded(mdi_balance), Recorded(spread_reward)]
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=recorded,
                             args=make_args(tmp_path, max_steps=3, log_full_rollouts_per_step=4),
                             train_dataset=grpo_train_dataset)
    watcher = SizeWatcher(rollout_log)
    trainer.add_callback(watcher)
    trainer.train()
    # The file grew while the run was in progress, step by step (read from a callback, not after training).
    assert len(watcher.sizes) == 3 and watcher.sizes[0] > 0 and watcher.sizes == sorted(set(watcher.sizes))
    text = rollout_log.read_text()
    body = _outside_fences(text)
    assert [int(s) for s in STEP_HEADER.findall(body)] == [1, 2, 3]
    assert body.count("<!-- trl_mdi:header kind=rollout") == 1
    # Every rollout's reward values in the file equal what the reward functions returned.
    logged = {r.__name__: r.values for r in recorded}
    assert all(len(v) == 12 for v in logged.values())
    blocks = re.split(r"^### Rollout ", body, flags=re.M)[1:]
    assert len(blocks) == 12  # 3 steps x 4 rollouts, all written in full
    # Multiple-choice rows: the parsed letter, the gold letter with its choice, the format verdict.
    assert all(re.search(r"^\*\*Parsed answer:\*\* (?:[A-J/]+|none) · \*\*Gold answer:\*\* [A-D] \(\w+\) · "
                         r"\*\*Format:\*\* ", b, re.M) for b in blocks), blocks[0][:600]
    for k, block in enumerate(blocks):
        for name in trainer.reward_func_names:
            m = re.search(rf"^\| {name} \| ([^|]+) \|", block, re.M)
            assert m, (name, block[:300])
            assert float(m.group(1)) == pytest.approx(logged[name][k], rel=1e-3, abs=1e-4), (name, k)
    att = _outside_fences(attention_log.read_text())
    assert [int(s) for s in STEP_HEADER.findall(att)] == [1, 2, 3]
    assert "Mean MDI trend" in att and "![attention map, step 1" in att
    # Attention rows carry the rollout log's # and prompt group (consecutive blocks of num_generations).
    first_table = att.split("### Rollouts (4)\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert first_table[0].startswith("| # | group | MDI early |"), first_table[0]
    cols = [[c.strip() for c in row.strip("|").split("|")][:2] for row in first_table[2:]]
    assert cols == [[str(i), str(i // trainer.num_generations)] for i in range(4)], cols
    pngs = sorted((attention_log.parent).rglob("*.png"))
    assert pngs and all(p.stat().st_size > 0 for p in pngs)


def test_a_free_form_task_gets_logs_without_multiple_choice_columns(model_dir, grpo_train_dataset, tmp_path, capsys):
    """TRL's accuracy_reward on rows with a text ``solution`` and no label_idx / choices: the rollout log shows the
    solution as gold, marks right / wrong from the accuracy reward, and has no parsed letter and no format verdict;
    the console shows the accuracy reward's mean."""
    from trl.rewards import accuracy_reward

    rows = grpo_train_dataset.remove_columns(["label_idx", "choices"]).map(lambda _: {"solution": "$4$"})
    rollout_log, attention_log = _logs(tmp_path)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[accuracy_reward, spread_reward],
                             args=make_args(tmp_path, max_steps=1, log_full_rollouts_per_step=1), train_dataset=rows)
    trainer.train()
    body = _outside_fences(rollout_log.read_text())
    assert "**Gold answer:** $4$" in body and "Parsed answer" not in body and "**Format:**" not in body
    header = [c.strip() for c in body.split("### Other rollouts (3)\n\n", 1)[1].split("\n", 1)[0].strip("|").split("|")]
    assert header == ["#", "group", "accuracy_reward", "spread_reward", "total", "advantage", "correct", "length",
                      "gold", "completion"], header
    assert "| accuracy | 0 |" in body and "clean format" not in body  # the random model never writes 4
    assert "### Rollouts (4)" in attention_log.read_text()  # the attention log is the same as for any task
    assert "rewards/accuracy_reward/mean" in capsys.readouterr().out


def test_hostile_completions_stay_valid_markdown(model_dir, grpo_train_dataset, tmp_path):
    processor = AutoProcessor.from_pretrained(model_dir)
    hostile = "`````\n## Step 99\n<script>alert(1)</script>\x07\x1b[31m | a | b |\n```"
    ids = processor.tokenizer.encode(hostile, add_special_tokens=False)

    def rollout_func(prompts, trainer):
        prompt_ids = [processor.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                      ["input_ids"][0] for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": [ids] * len(prompts),
                "logprobs": [[0.0] * len(ids)] * len(prompts)}

    rollout_log, _ = _logs(tmp_path)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path, max_steps=1),
                             train_dataset=grpo_train_dataset, rollout_func=rollout_func)
    trainer.train()
    text = rollout_log.read_text()
    body = _outside_fences(text)
    assert [int(s) for s in STEP_HEADER.findall(body)] == [1]  # the fake "## Step 99" stayed inside a fence
    assert "<script>" not in body  # HTML outside fences is escaped
    assert "\x07" not in text and "\x1b" not in text  # control characters removed
    from markdown_it import MarkdownIt

    tokens = MarkdownIt().parse(text)
    assert sum(t.type == "heading_open" and t.tag == "h2" for t in tokens) == 1


def test_crash_full_disk_and_resume_keep_every_log_and_no_half_checkpoint(model_dir, grpo_train_dataset, tmp_path,
                                                                          monkeypatch):
    """Issue 38, items 1 and 3, end to end. Run 1 (``--run_name exp``) saves checkpoints 1 and 2, then the disk fills
    while checkpoint-3's optimizer.pt is written: the error names the cause, checkpoint-3 is gone, and the logs' last
    lines say the run stopped and why. Run 2 resumes with ``true`` and no run name (docs/training.md's recipe): it
    skips a checkpoint-3 a kill left half-written, takes checkpoint-2, and continues run 1's own logs: run 1's step 3
    kept and marked undone, each step counted once. Run 3, fresh with the same run name, gets files of its own."""
    import errno

    from trl_mdi.checkpoints import MARKER, CheckpointSaveError, recorded_logs

    monkeypatch.setenv("TRL_MDI_LOG_DIR", str(tmp_path / "tl"))
    logs, out = tmp_path / "tl", tmp_path / "out"
    args = functools.partial(make_args, tmp_path, max_steps=3, save_strategy="steps", save_steps=1,
                             rollout_log_path=None, attention_diag_log_path=None)
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith(os.path.join("checkpoint-3", "optimizer.pt")):
            Path(f).write_bytes(b"PK\x03\x04 cut")  # what a full disk leaves behind
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    first = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=args(run_name="exp"),
                           train_dataset=grpo_train_dataset)
    with pytest.raises(CheckpointSaveError, match=r"checkpoint-3 failed while writing optimizer.pt: No space left on "
                                                  r"device\. The partial folder was removed; the latest whole "
                                                  r"checkpoint is .*checkpoint-2\."):
        first.train()
    monkeypatch.setattr(torch, "save", real_save)
    rollout_log, attention_log = logs / "rollout_results_exp.md", logs / "attention_diagnostics_exp.md"
    crashed = rollout_log.read_text()
    assert [int(s) for s in STEP_HEADER.findall(_outside_fences(crashed))] == [1, 2, 3]
    for path in (rollout_log, attention_log):
        last = path.read_text().rstrip().splitlines()[-2:]
        assert last[0].startswith("> **Run stopped** at step 3 · ") and "No space left on device" in last[0], path
        assert last[1] == "<!-- trl_mdi:stopped step=3 -->"
    assert not (out / "checkpoint-3").exists() and (out / "checkpoint-2" / MARKER).is_file()
    killed = out / "checkpoint-3"  # a save killed part-way: no trainer_state.json, optimizer.pt cut
    killed.mkdir()
    (killed / "optimizer.pt").write_bytes(b"PK\x03\x04 cut")

    second = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=args(),
                            train_dataset=grpo_train_dataset)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 3 and recorded_logs(out / "checkpoint-3")["rollouts"] == str(rollout_log)
    assert sorted(p.name for p in logs.glob("*.md")) == [attention_log.name, rollout_log.name]
    for path in (rollout_log, attention_log):
        text = path.read_text()
        body = _outside_fences(text)
        assert [int(s) for s in STEP_HEADER.findall(body)] == [1, 2, 3], path.name
        assert body.count("trl_mdi:header kind=") == 1
        order = ["**Undone by the resume from step 2**", "### Undone step 3 ", "> **Run stopped** at step 3",
                 "**Resumed at step 2**", "\n## Step 3 "]
        assert sorted(order, key=body.index) == order, path.name
    # Steps 1-2 are kept byte for byte from the first run, and so is its step 3, under "Undone".
    text = rollout_log.read_text()
    assert text.startswith(crashed[: crashed.index("\n## Step 3")])
    old3 = crashed[crashed.index("\n## Step 3"):].split("\n", 2)[2].split("<!-- trl_mdi:end")[0]
    assert old3 in text[text.index("### Undone step 3"):]

    third = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                           args=args(run_name="exp", output_dir=str(tmp_path / "out3")), train_dataset=grpo_train_dataset)
    third.live_logs.on_train_begin(third.args, third.state, third.control)  # what a fresh train() does first
    assert rollout_log.read_text() == text and third.live_logs.rollout_path.name == "rollout_results_exp-2.md"
    assert sorted(p.name for p in logs.glob("rollout_results_*.md")) == ["rollout_results_exp-2.md",
                                                                          "rollout_results_exp.md"]


def test_unwritable_log_path_fails_at_construction(model_dir, grpo_train_dataset, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(LogPathError, match="a_file"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                       args=make_args(tmp_path, rollout_log_path=str(blocker / "rollouts.md")),
                       train_dataset=grpo_train_dataset)


def test_full_disk_mid_run_warns_once_and_training_continues(model_dir, grpo_train_dataset, tmp_path, monkeypatch):
    import errno
    import os

    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(tmp_path, max_steps=3),
                             train_dataset=grpo_train_dataset)
    real_fsync = os.fsync
    calls = {"n": 0}

    def failing_fsync(fd):
        calls["n"] += 1
        if calls["n"] > 2:  # header + step 1 go through, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.warns(RuntimeWarning, match="No space left") as record:
        trainer.train()
    assert trainer.state.global_step == 3
    # Once per log file (rollouts, attention), not once per step.
    messages = [str(w.message) for w in record if "No space left" in str(w.message)]
    assert len(messages) == 2
    assert any("rollouts.md" in m for m in messages) and any("attention.md" in m for m in messages)


def test_logging_off_writes_nothing(model_dir, grpo_train_dataset, tmp_path):
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, max_steps=1, realtime_rollout_logging=False),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    assert not any(p.exists() for p in _logs(tmp_path))
    assert torch.is_grad_enabled()


def test_attention_log_links_a_per_layer_mdi_picture_every_n_steps(model_dir, grpo_train_dataset, tmp_path):
    """Step 1 and every attention_map_every_n_steps: a per-layer MDI picture of the step's rollouts (the profile
    command's plotting code), linked from the attention log so that `tail -f` readers can open it."""
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, max_steps=3, attention_map_every_n_steps=2),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    log = tmp_path / "logs" / "attention.md"
    text = log.read_text()
    links = re.findall(r"!\[MDI by layer, step (\d+)\]\(([^)]+)\)", text)
    assert [int(step) for step, _ in links] == [1, 2]
    for _, rel in links:
        png = log.parent / rel
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def half_answered_generation(monkeypatch):
    """Replace TRL's generation: even rollouts end with an answer line (A, B, ...), odd ones have none."""
    from trl import GRPOTrainer

    def generate(trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tok = trainer._tokenizer
        think = tok("<think>look</think>", add_special_tokens=False)["input_ids"]
        answer = [tok("\nAnswer: " + "ABCD"[i // 2 % 4], add_special_tokens=False)["input_ids"] if i % 2 == 0 else []
                  for i in range(len(prompt_ids))]
        return [think + a + [tok.eos_token_id] for a in answer], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", generate)


@pytest.mark.parametrize("attention", [True, False], ids=["attention-on", "attention-off"])
def test_reliance_signals_in_the_rollout_log(model_dir, grpo_train_dataset, tmp_path, monkeypatch, capsys, attention):
    """reliance_signals=True: every rollout's visual gain, answer visual gain and blind verdict in the rollout log
    (columns, and a worded line in the full rollouts), the step summary's blind-agreement rate, mean gains and answer
    rate equal to the reliance/* metrics the trainer logged for the same batch, a blind-agreement trend, the
    blind-agreement rate on the console; an attention log without any of it, or none with attention metrics off (the
    signals need no probe; the answer letter's image attention is then left out)."""
    from trl_mdi.rewards import mc_idx

    half_answered_generation(monkeypatch)
    rollout_log, attention_log = _logs(tmp_path)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[mc_idx, spread_reward],
                             args=make_args(tmp_path, max_steps=2, log_full_rollouts_per_step=2, reliance_signals=True,
                                            compute_attention_metrics=attention),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    body = _outside_fences(rollout_log.read_text())
    metrics = [h for h in trainer.state.log_history if "loss" in h]
    blocks = re.split(r"^## Step \d+ ", body, flags=re.M)[1:]
    assert len(blocks) == len(metrics) == 2
    line = re.compile(r"^\*\*Reliance on the image\*\* \(counterfactual: a black image of the same size\): (.*)$", re.M)
    for block, logged in zip(blocks, metrics):
        answered, unanswered = line.findall(block)  # rollouts 0 and 1, in full
        assert re.fullmatch(r"visual gain [+-][\d.e+-]+ nats per token · answer visual gain [+-][\d.e+-]+ nats · "
                            r"blind answer agrees: (yes \(the answer would have been the same without the image\)|"
                            r"no \(without the image the answer would have been different\))"
                            + (r" · image attention at the answer letter [\d.e-]+" if attention else ""), answered), answered
        assert re.fullmatch(r"visual gain [+-][\d.e+-]+ nats per token · answer visual gain — \(no answer line\) · "
                            r"blind answer agrees: — \(no answer letter to compare\)", unanswered), unanswered
        # Each full rollout says which of its tokens came from the image (issue 30 item 5): a marked line or "none".
        evidence = re.findall(r"^\*\*Image evidence(\*\* \(tokens at least 1 nat likelier|:\*\* none)", block, re.M)
        assert len(evidence) == 2, block
        table = block.split("### Other rollouts (2)\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
        header = [c.strip() for c in table[0].strip("|").split("|")]
        assert header[-4:] == ["vis gain", "ans gain", "blind", "completion"], header
        rows = [dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in table[2:]]
        assert [r["#"] for r in rows] == ["2", "3"]
        assert rows[0]["ans gain"] != "—" and rows[0]["blind"] in ("yes", "no")  # rollout 2 answered
        assert rows[1]["ans gain"] == "—" and rows[1]["blind"] == "—" and rows[1]["vis gain"] != "—"
        summary = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", block.split("### Step summary", 1)[1], re.M))
        answer_rate = float(summary["answer rate (rollouts with an image and an answer)"])
        assert answer_rate == logged["reliance/answer_rate"] == 0.5
        # One summary row per counterfactual metric signal of the table, equal to its reliance/* metric; the
        # answer letter's image attention only with the probe on.
        rows = {summary_label(s): s.metric_key for s in S.SIGNALS if s.source == S.COUNTERFACTUAL and s.metric
                and (attention or s.name != "answer_image_attention")}
        assert [k for k in summary if k in rows or k.startswith("answer rate")] == [*rows, "answer rate (rollouts "
                                                                                   "with an image and an answer)"]
        assert "blind agreement (share of answers unchanged without the image)" in rows
        for label, key in rows.items():
            assert float(summary[label]) == pytest.approx(logged[key], rel=1e-3, abs=1e-6), label
    assert re.search(r"^Blind agreement trend: `..` .* \(2 points\)$", blocks[1], re.M)
    assert "reliance/blind_agree_rate" in capsys.readouterr().out
    if not attention:
        assert not attention_log.exists()
        return
    att = _outside_fences(attention_log.read_text())
    assert [int(s) for s in STEP_HEADER.findall(att)] == [1, 2]
    assert not re.search(r"gain|blind agree|reliance", att, re.I), "reliance signals leaked into the attention log"
