"""Trackers receive the trainer's metrics and TRL's completions table: trackio (local) and wandb (offline), read back
from what they stored.

Each test trains the tiny VLM for 2 steps with every TPRL part, the reliance signals and `log_completions` on and
`report_to=[tracker]`, then reads the tracker's own on-disk record and checks that the attention/*, tprl/*, perf/*
and rewards/* metrics of both steps are there, with the values the trainer logged, and that each step's completions
table carries a column per per-rollout signal, row for row the trainer's values, with step 1's visual_gain equal to
two plain forwards per rollout (with the image and with a black one), and the image column. Trainer.log's integrations prefix train metrics with "train/"
(`rewrite_logs`), so "attention/mdi" is stored as "train/attention/mdi".

The training runs in a child Python process, with every tracker directory pointed at tmp_path through the
environment. It cannot run in this process: trackio reads TRACKIO_DIR (and HF_HOME) once, when it is imported,
and TRL's grpo_trainer imports trackio at import time, i.e. as soon as any test module imports trl_mdi.trainer.
A setenv here would come too late and trackio would write to ~/.cache/huggingface/trackio. The child also keeps
wandb's service process (wandb-core), trackio's CPU-logging thread and both trackers' atexit hooks out of the
pytest process. The child blocks and records any socket connection or DNS lookup to a non-local host.

How each tracker is read back, without network:
- trackio: its local SQLite database, TRACKIO_DIR/<project>.db, table `metrics` (one row per trackio.log call,
  the metrics as a JSON object in the `metrics` column).
- trackio's table: the same store, the row of TRL's own trackio.log call (`completions`: trackio's table record, its
  rows as JSON objects). wandb's table: files/media/table/completions_<step>_<hash>.table.json in the run's folder.
- wandb: the offline run's transaction log, WANDB_DIR/wandb/offline-run-*/run-<id>.wandb. Offline runs write no
  files/wandb-summary.json, and wandb 0.31 ships no Python reader for that log any more (the old
  wandb.sdk.internal.datastore is gone; `wandb sync` is in Go and uploads). The log is in LevelDB's log format
  behind a 7-byte ":W&B" header; each record is a wandb_internal_pb2.Record, parsed with wandb's own protobuf
  classes. History records hold one row per wandb.log call.
"""

import json
import math
import os
import sqlite3
import struct
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
PROJECT = "trl-mdi-trackers"
RUN_NAME = "tracker-test"

# One metric or more per namespace, as the trainer names them (the trackers store them under "train/").
METRICS = (
    "attention/mdi", "attention/mdi_early", "attention/mdi_late", "attention/aei_text", "attention/aei_image",
    "attention/mdi_middle", "attention/image_mass", "attention/rows_without_image",
    "tprl/entropy_token_fraction", "tprl/perception_token_fraction", "tprl/sensitivity_score_mean",
    "tprl/scaling_factor_mean", "tprl/scaling_factor_min", "tprl/scaling_factor_max", "tprl/rows_without_image",
    "perf/tokens_per_second", "perf/samples_per_second", "perf/generation_seconds", "perf/scoring_seconds",
    "perf/update_seconds",
    "rewards/spread_reward/mean", "rewards/spread_reward/std", "rewards/spread_reward/zero_spread_frac",
)

CHILD = r'''
import json, os, socket, sys
from pathlib import Path

# --- no network: record (and refuse) any connection or DNS lookup to a non-local host -------------------------
_LOCAL = {"127.0.0.1", "::1", "localhost", "0.0.0.0", ""}
_connect, _getaddrinfo = socket.socket.connect, socket.getaddrinfo

def _refuse(host, what):
    if isinstance(host, bytes):
        host = host.decode()
    if isinstance(host, str) and host not in _LOCAL:
        with open(os.environ["TRACKER_TEST_NETWORK_LOG"], "a") as f:
            f.write(f"{what} {host}\n")
        raise OSError(f"network access blocked by test_trackers: {what} {host}")

def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _refuse(address[0], "connect")
    return _connect(self, address)

def getaddrinfo(host, *args, **kwargs):
    _refuse(host, "getaddrinfo")
    return _getaddrinfo(host, *args, **kwargs)

socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo

# --- train 2 steps, all TPRL parts on, reporting to one tracker ------------------------------------------------
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["tests_dir"])
from datasets import load_from_disk  # noqa: E402
from test_trainer import make_args, spread_reward  # noqa: E402
from test_reliance_trainer import capture  # noqa: E402
from test_trainer_tprl import TPRL_ALL  # noqa: E402
from pytest import MonkeyPatch  # noqa: E402

from trl_mdi.trainer import MDIGRPOTrainer  # noqa: E402

seen = capture(MonkeyPatch())  # each batch's rollouts as the counterfactual forward saw them
args = make_args(Path(cfg["work"]), report_to=[cfg["tracker"]], project=cfg["project"], run_name=cfg["run_name"],
                 log_completions=True, reliance_signals=True, **TPRL_ALL)
trainer = MDIGRPOTrainer(cfg["model_dir"], reward_funcs=[spread_reward], args=args,
                         train_dataset=load_from_disk(cfg["dataset_dir"]))
trainer.train()
# Step 1's rollouts, scored independently: two plain forwards of the checkpoint per rollout (with its image and with
# a black one of the same size), for the completions table's visual_gain.
from test_trackers import plain_visual_gain  # noqa: E402

Path(cfg["table_out"]).write_text(json.dumps({
    "visual_gain": plain_visual_gain(cfg["model_dir"], seen[0]),
    "signals": {n: [None if v != v else v for v in t.tolist()] for n, t in seen[0]["signals"].items()},
}))
if cfg["tracker"] == "wandb":
    import wandb

    wandb.finish()  # transformers' WandbCallback leaves the run open at the end of training
Path(cfg["history_out"]).write_text(json.dumps([h for h in trainer.state.log_history if "loss" in h]))
'''


@pytest.fixture(scope="module")
def saved_dataset(grpo_train_dataset, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trackers-data") / "train"
    grpo_train_dataset.save_to_disk(str(path))
    return path


@pytest.fixture
def run_child(tiny_vlm_dir, saved_dataset, tmp_path, monkeypatch):
    """Runs the training child with every tracker, cache and home directory under tmp_path; returns its history."""
    model_dir = tiny_vlm_dir("qwen2_5_vl")  # built (once per session) here, not inside the timed child
    dirs = {name: tmp_path / name for name in ("cwd", "home", "hf_home", "trackio", "wandb", "wandb_cache",
                                               "wandb_config", "wandb_data", "wandb_artifacts", "work")}
    for d in dirs.values():
        d.mkdir()
    env = {
        "HOME": dirs["home"], "XDG_CACHE_HOME": dirs["home"] / ".cache", "XDG_CONFIG_HOME": dirs["home"] / ".config",
        "HF_HOME": dirs["hf_home"], "TRACKIO_DIR": dirs["trackio"],
        "WANDB_MODE": "offline", "WANDB_DIR": dirs["wandb"], "WANDB_CACHE_DIR": dirs["wandb_cache"],
        "WANDB_CONFIG_DIR": dirs["wandb_config"], "WANDB_DATA_DIR": dirs["wandb_data"],
        "WANDB_ARTIFACT_DIR": dirs["wandb_artifacts"], "WANDB_PROJECT": PROJECT, "WANDB_SILENT": "true",
        "WANDB_LOG_MODEL": "false", "WANDB_WATCH": "false", "WANDB_DISABLE_GIT": "true",
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TRACKER_TEST_NETWORK_LOG": tmp_path / "network_attempts.log",
        "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS_DIR.parent), os.environ.get("PYTHONPATH")) if p),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    # Anything that would send trackio to a Space, a server or a Hub bucket, or wandb online.
    for key in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_WRITE_TOKEN", "TRACKIO_BUCKET_ID",
                "TRACKIO_DATASET_ID", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(key, raising=False)

    def run(tracker: str) -> tuple[list[dict], dict[str, Path]]:
        cfg = dict(tracker=tracker, tests_dir=str(TESTS_DIR), model_dir=str(model_dir),
                   dataset_dir=str(saved_dataset), work=str(dirs["work"]), project=PROJECT, run_name=RUN_NAME,
                   history_out=str(tmp_path / "history.json"), table_out=str(tmp_path / "table.json"))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], cwd=dirs["cwd"], capture_output=True,
                              text=True, timeout=180)
        print(f"{tracker} child: {time.perf_counter() - start:.1f}s")
        assert proc.returncode == 0, f"training child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        attempts = tmp_path / "network_attempts.log"
        assert not attempts.exists(), f"network access attempted:\n{attempts.read_text()}"
        assert not any(dirs["cwd"].iterdir()), f"files left in the working directory: {list(dirs['cwd'].iterdir())}"
        history = json.loads((tmp_path / "history.json").read_text())
        assert [h["step"] for h in history] == [1, 2], history
        dirs["table"] = json.loads((tmp_path / "table.json").read_text())
        return history, dirs

    return run


def check_received(stored: dict[int, dict], history: list[dict]) -> None:
    """`stored`: what the tracker persisted, per global step. Every metric of every step, with the trainer's value."""
    assert sorted(stored) == [1, 2], f"steps stored: {sorted(stored)}"
    for logged in history:
        row = stored[logged["step"]]
        missing = [m for m in METRICS if f"train/{m}" not in row]
        assert not missing, f"step {logged['step']}: tracker did not receive {missing}; it has {sorted(row)}"
        for m in METRICS:
            assert m in logged, f"the trainer did not log {m}"  # if this fails, METRICS is out of date
            value = row[f"train/{m}"]
            assert isinstance(value, (int, float)) and math.isfinite(value), (m, value)
            assert value == pytest.approx(logged[m], rel=1e-6, abs=1e-9), (m, value, logged[m])
        assert row["train/perf/tokens_per_second"] > 0 and row["train/perf/samples_per_second"] > 0
        # 8-token completions, top-p 0.25: each TPRL filter keeps 2 of 8 tokens (see test_trainer_tprl.py).
        assert row["train/tprl/entropy_token_fraction"] == pytest.approx(0.25)
        assert row["train/tprl/perception_token_fraction"] == pytest.approx(0.25)


def plain_visual_gain(model_dir, batch) -> list[float]:
    """visual_gain of each rollout of ``batch`` (what the counterfactual forward saw) from two plain forwards of the
    checkpoint per rollout, with its image and with a black one (tests/test_reliance_trainer.py's reference)."""
    from PIL import Image
    from test_reliance_trainer import plain_reference
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    out = []
    for prompt, row, completion in zip(batch["prompts"], batch["inputs"], batch["completions"]):
        images = row["images"] if row.get("images") is not None else [row["image"]]
        black = [Image.new("RGB", img.size, (0, 0, 0)) for img in images]
        real, _ = plain_reference(model, processor, prompt, images, completion)
        cf, _ = plain_reference(model, processor, prompt, black, completion)
        out.append(float((real - cf).mean()))
    return out


def number(cell) -> float:
    """A table cell as a float: NaN stored as null, "NaN" or NaN, whichever the tracker chose."""
    return math.nan if cell is None or cell == "NaN" else float(cell)


def check_table(rows: list[dict], step: int, table: dict) -> None:
    """The completions table a tracker stored for ``step`` (one dict per rollout, TRL's order): TRL's own columns and
    a column per measured signal, equal to the trainer's values row by row; at step 1 visual_gain also equals the
    plain-forward recomputation; finite where defined and varying across rollouts; the image column present."""
    assert rows and all(r["step"] == step for r in rows), rows[:1]
    for column in ("prompt", "completion", "advantage", "spread_reward", "image_evidence", "image"):
        assert column in rows[0], f"the table has no {column!r} column: {sorted(rows[0])}"
    signals = table["signals"]
    missing = sorted(set(signals) - set(rows[0]))
    assert not missing, f"the tracker's table lacks {missing}"
    if step == 1:
        for name, values in signals.items():
            got = [number(r[name]) for r in rows]
            want = [math.nan if v is None else v for v in values]
            assert got == pytest.approx(want, abs=1e-6, nan_ok=True), name
        got = [number(r["visual_gain"]) for r in rows]
        assert got == pytest.approx(table["visual_gain"], abs=1e-5)
    for name in ("visual_gain", "mdi", "mdi_late", "mdi_balance"):
        values = [number(r[name]) for r in rows]
        assert all(math.isfinite(v) for v in values), (name, values)  # every rollout has an image and a completion
        assert len(set(values)) > 1, (name, values)
    assert all(r["image"] for r in rows), "every rollout of this dataset has an image"


# ----------------------------------------------------------------------------------------------------- trackio
def read_trackio(trackio_dir: Path, project: str, run_name: str) -> dict[int, dict]:
    """Rows of trackio's local SQLite store for one run, keyed by the logged train/global_step."""
    db = trackio_dir / f"{project}.db"
    assert db.exists(), f"no trackio database at {db}; {trackio_dir} holds {sorted(p.name for p in trackio_dir.iterdir())}"
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step", (run_name,)).fetchall()
    assert rows, f"no metrics rows for run {run_name!r} in {db}"
    stored, tables = {}, {}
    for _, blob in rows:
        metrics = json.loads(blob)
        if "train/loss" in metrics:  # per-step logs; the end-of-training summary log has no loss
            stored[int(metrics["train/global_step"])] = metrics
        elif "completions" in metrics:  # TRL's completions table, logged by its own trackio.log call
            table = metrics["completions"]
            assert table["_type"] == "trackio.table", table
            tables[table["_value"][0]["step"]] = table["_value"]  # the last one of a step wins, as in the parquet
    return stored, tables


@pytest.mark.slow
def test_trackio_receives_metrics(run_child):
    history, dirs = run_child("trackio")
    stored, tables = read_trackio(dirs["trackio"], PROJECT, RUN_NAME)
    check_received(stored, history)
    assert sorted(tables) == [1, 2], sorted(tables)
    for step, rows in tables.items():
        check_table(rows, step, dirs["table"])
    # Nothing went to trackio's default location under HF_HOME.
    assert not (dirs["hf_home"] / "trackio").exists()


# ------------------------------------------------------------------------------------------------------- wandb
def wandb_records(path: Path):
    """The records of a .wandb transaction log (LevelDB log format after a ':W&B' header), as wandb protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a wandb transaction log"
    block, pos, chunks = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding (preallocated tail)
            pos += left - 7
            continue
        chunks += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE.../LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def read_wandb(wandb_dir: Path) -> tuple[dict[int, dict], list]:
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline run under {wandb_dir}, found {runs}"
    logs = list(runs[0].glob("run-*.wandb"))
    assert len(logs) == 1, f"expected one transaction log in {runs[0]}, found {logs}"
    records = list(wandb_records(logs[0]))
    stored = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
            if "train/loss" in row:
                stored[int(row["train/global_step"])] = row
    return stored, records


def read_wandb_tables(wandb_dir: Path) -> dict[int, list[dict]]:
    """The completions tables of the offline run, one per step (the last one of a step wins, as in the parquet):
    wandb writes each logged Table to files/media/table/<key>_<step>_<hash>.table.json, columns and rows."""
    tables = {}
    paths = sorted((wandb_dir / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"),
                   key=lambda p: p.stat().st_mtime)
    assert paths, f"no completions table under {wandb_dir}"
    for path in paths:
        stored = json.loads(path.read_text())
        rows = [dict(zip(stored["columns"], row)) for row in stored["data"]]
        tables[rows[0]["step"]] = rows
    return tables


@pytest.mark.slow
def test_wandb_offline_receives_metrics(run_child):
    history, dirs = run_child("wandb")
    stored, records = read_wandb(dirs["wandb"])
    check_received(stored, history)
    tables = read_wandb_tables(dirs["wandb"])
    assert sorted(tables) == [1, 2], sorted(tables)
    for step, rows in tables.items():
        check_table(rows, step, dirs["table"])
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[-1] == "exit" and records[-1].exit.exit_code == 0, "the run was not finished cleanly"
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == PROJECT and run.display_name == RUN_NAME
