"""Issue 38, items 2 and 3, without a model: one run per output_dir (trl_mdi.run_lock), checkpoints whole or refused
(trl_mdi.checkpoints), a failed save's message. The trainer's side is in test_live_logs.py
(test_crash_full_disk_and_resume_keep_every_log_and_no_half_checkpoint); the entry point's in test_entry_point.py."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from trl_mdi.checkpoints import (
    MARKER,
    CheckpointError,
    mark_complete,
    recorded_logs,
    resolve_resume,
    resume_problems,
    save_failure,
)
from trl_mdi.run_lock import LOCK_NAME, RunLockedError, lock_output_dir


def whole_checkpoint(folder, *, lora=False, deepspeed=False, marker=True):
    """A checkpoint folder with every file a resume reads (tiny, but each file valid in its own format)."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    if deepspeed:
        (folder / "latest").write_text("global_step2")
        (folder / "global_step2").mkdir()
        torch.save({"m": 1}, folder / "global_step2" / "mp_rank_00_model_states.pt")
        torch.save({"o": 1}, folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    else:
        save_file({"w": torch.zeros(64)}, str(folder / ("adapter_model.safetensors" if lora else "model.safetensors")))
        torch.save({"state": torch.zeros(64)}, folder / "optimizer.pt")
        torch.save({"lr": 1}, folder / "scheduler.pt")
    if lora:
        (folder / "adapter_config.json").write_text("{}")
    if marker:
        mark_complete(folder, logs={"rollouts": "/logs/r.md"})
    return folder


def cut(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def names(problems):
    return sorted(p.name for p in problems)


def test_resume_names_what_a_checkpoint_lacks(tmp_path):
    ok = whole_checkpoint(tmp_path / "checkpoint-2")
    assert resume_problems(ok) == [] and recorded_logs(ok) == {"rollouts": "/logs/r.md"}
    # A save killed part-way: optimizer.pt cut, no trainer_state.json (transformers writes it last), no marker.
    killed = whole_checkpoint(tmp_path / "killed", marker=False)
    cut(killed / "optimizer.pt")
    (killed / "trainer_state.json").unlink()
    assert names(resume_problems(killed)) == ["optimizer.pt", "trainer_state.json"]
    with pytest.raises(CheckpointError) as e:
        resolve_resume(str(killed), tmp_path)
    message = str(e.value)
    assert "\n" not in message and f"cannot resume from {killed}: it lacks trainer_state.json and has optimizer.pt cut" \
        " short (its zip archive has no end record" in message
    assert f"resume from {ok} (whole)" in message and "weights and cut files cannot be skipped" in message
    # Each file a resume needs, missing: named; optimizer / scheduler / trainer state may be skipped on request only.
    for kind, remove, expected in [("plain", "optimizer.pt", "lacks optimizer.pt"),
                                   ("plain", "model.safetensors", "lacks the model weights"),
                                   ("lora", "adapter_model.safetensors", "lacks adapter_model.safetensors (LoRA)"),
                                   ("deepspeed", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    "lacks global_step2/*optim_states.pt")]:
        folder = whole_checkpoint(tmp_path / kind / remove.replace("/", "_"), lora=kind == "lora",
                                  deepspeed=kind == "deepspeed", marker=False)
        (folder / remove).unlink()
        with pytest.raises(CheckpointError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
            resolve_resume(str(folder), tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint-9: no such folder\. Whole checkpoints in .*: checkpoint-2 \(or"):
        resolve_resume(str(tmp_path / "checkpoint-9"), tmp_path)
    partial = tmp_path / "plain" / "optimizer.pt"
    assert "set allow_partial_resume: true" in _error(partial, tmp_path)
    path, notes = resolve_resume(str(partial), tmp_path, allow_partial=True)
    assert path == str(partial) and len(notes) == 1 and "lacks optimizer.pt; that state restarts fresh" in notes[0]
    with pytest.raises(CheckpointError, match="lacks the model weights"):  # weights are never optional
        resolve_resume(str(tmp_path / "plain" / "model.safetensors"), tmp_path, allow_partial=True)
    # A truncated model.safetensors (the traceback after the weights loaded) and a marker's size that differs.
    truncated = whole_checkpoint(tmp_path / "truncated", marker=False)
    cut(truncated / "model.safetensors", 0.9)
    assert "has model.safetensors cut short (" in _error(truncated, tmp_path)
    grown = whole_checkpoint(tmp_path / "grown")
    with open(grown / "scheduler.pt", "ab") as f:
        f.write(b"x")
    # Issue 42: a file that grew is not "cut short"; the message gives the size found against the size saved.
    size = (grown / "scheduler.pt").stat().st_size
    assert f"has scheduler.pt changed since the save ({size} bytes found, {size - 1} saved)" in _error(grown, tmp_path)
    shrunk = whole_checkpoint(tmp_path / "shrunk")
    cut(shrunk / "scheduler.pt", 0.5)
    size = (shrunk / "scheduler.pt").stat().st_size
    assert re.search(rf"has scheduler\.pt cut short \({size} bytes found, \d+ saved\)", _error(shrunk, tmp_path))


def _error(folder, output_dir):
    with pytest.raises(CheckpointError) as e:
        resolve_resume(str(folder), output_dir)
    return str(e.value)


def test_resume_true_takes_the_newest_whole_checkpoint(tmp_path):
    """--resume_from_checkpoint true (transformers' get_last_checkpoint took the highest number, whole or not)."""
    assert resolve_resume(None, tmp_path) == (None, []) and resolve_resume("false", tmp_path) == (None, [])
    whole_checkpoint(tmp_path / "checkpoint-2")
    killed = whole_checkpoint(tmp_path / "checkpoint-10", marker=False)
    (killed / "trainer_state.json").unlink()
    (tmp_path / "checkpoint-12").mkdir()  # killed before the first file
    for value in (True, "true", "True"):
        path, notes = resolve_resume(value, tmp_path)
        assert path == str(tmp_path / "checkpoint-2"), value
        assert [n.split(" (")[0] for n in notes] == ["resume: skipped checkpoint-12", "resume: skipped checkpoint-10"]
    assert resolve_resume(True, tmp_path, allow_partial=True)[0] == str(tmp_path / "checkpoint-2")  # whole first
    (tmp_path / "checkpoint-2" / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError) as e:
        resolve_resume(True, tmp_path)
    assert str(e.value).startswith(f"--resume_from_checkpoint true: no whole checkpoint in {tmp_path} (checkpoint-12 "
                                   "lacks trainer_state.json")
    # No whole one, allow_partial_resume: the newest that lacks only optional state.
    path, notes = resolve_resume(True, tmp_path, allow_partial=True)
    assert path == str(killed) and "allow_partial_resume" in notes[-1]


def test_a_failed_save_names_the_cause(monkeypatch):
    """torch's own message for a full disk is '[enforce fail at inline_container.cc:672] . unexpected pos ...'."""
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4864 vs 4752")
    err = save_failure("/nonexistent/out/checkpoint-4", torch_error, remove=True)
    assert "unexpected pos" in str(err)  # a short write with free space: torch's words, not a guess
    monkeypatch.setattr("trl_mdi.checkpoints._free_bytes", lambda path: 0)  # a full disk
    err = save_failure("/nonexistent/out/checkpoint-4", torch_error, remove=True)
    assert str(err).startswith("saving checkpoint /nonexistent/out/checkpoint-4 failed: No space left on device (0 MiB "
                               "free; torch said: [enforce fail")
    assert "The partial folder was removed; no whole checkpoint exists yet." in str(err)
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device", "optimizer.pt")
    assert "failed: No space left on device. The partial folder is left" in str(
        save_failure("/x/checkpoint-1", wrapped, remove=False))


HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"pid %d on testhost, started now" % os.getpid())
    print("locked", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def live_run(tmp_path):
    """Another process holding ``tmp_path/out``'s lock, as a live run does; ``kill()`` ends it with SIGKILL."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / LOCK_NAME)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"

    def kill():
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)

    yield out, kill
    kill()


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_one_run_per_output_dir_and_a_killed_run_leaves_no_stuck_lock(live_run):
    out, kill = live_run
    with pytest.raises(RunLockedError) as e:
        lock_output_dir(out)
    assert "\n" not in str(e.value) and f"output_dir {str(out)!r} is in use by another run (pid" in str(e.value)
    assert "on testhost" in str(e.value) and "give this run another --output_dir" in str(e.value)
    kill()  # kill -9: the kernel drops the lock with the process
    lock = lock_output_dir(out)
    again = lock_output_dir(out)  # re-entrant within one process (a second trainer in the same script)
    assert f"pid {os.getpid()} on " in (out / LOCK_NAME).read_text()
    again.release()
    lock.release()
    lock.release()  # idempotent
    assert not list(out.glob(MARKER))
