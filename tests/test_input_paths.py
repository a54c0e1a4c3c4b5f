"""No path mistake destroys an input (issue 42, item 5).

- An ``output_dir`` that is the model's folder (the run's final save overwrote the base ``model.safetensors``, rc 0),
  lies inside it, or holds a model no training run saved is refused before anything loads: by the entry point in one
  line, and by the trainer for library use.
- The A-OKVQA prep never writes into its source (``--out_dir`` equal to ``--dataset_path`` with ``--overwrite`` replaced
  the source parquet files, and their ``rationales`` and ``direct_answers`` were gone), and ``--overwrite`` replaces
  only the prep's own earlier outputs, which it marks.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from trl_mdi.aokvqa import OUTPUT_MARKER, OutDirNotEmptyError, marked_outputs, prepare_aokvqa
from trl_mdi.cli.command import main


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ output_dir
@pytest.fixture
def model_copy(tiny_vlm_dir, tmp_path) -> Path:
    """A tiny model in a folder of its own (the session's shared one must not be written to)."""
    return Path(shutil.copytree(tiny_vlm_dir("qwen2_5_vl"), tmp_path / "model"))


@pytest.mark.parametrize("where", ["the model folder", "inside the model folder", "a folder holding another model"])
def test_an_output_dir_that_would_overwrite_a_model_is_one_line_before_anything_loads(capsys, model_copy,
                                                                                       prepared_aokvqa_dir, tmp_path,
                                                                                       monkeypatch, where):
    from trl import GRPOTrainer

    loads = []
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: loads.append(a))
    other = tmp_path / "downloaded"
    if where == "a folder holding another model":
        shutil.copytree(model_copy, other)
    output_dir = {"the model folder": model_copy, "inside the model folder": model_copy / "grpo",
                  "a folder holding another model": other}[where]
    before = digests(model_copy)
    code = main(["--model_name_or_path", str(model_copy), "--dataset_path", str(prepared_aokvqa_dir),
                 "--output_dir", str(output_dir), "--max_steps", "1"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and loads == [] and len(lines) == 1, err
    expected = {"the model folder": "is the model's own folder", "inside the model folder": "lies inside the model's "
                "folder", "a folder holding another model": "holds a model no training run saved there (config.json, "
                "model.safetensors, and no training_args.bin)"}[where]
    assert lines[0].startswith(f"error: output_dir {str(output_dir)!r} {expected}") and "--output_dir runs/grpo" in err
    assert digests(model_copy) == before


def test_a_trainers_own_earlier_output_dir_is_accepted(capsys, tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    """A folder a training run saved into (its training_args.bin beside the weights) is the run's to replace, as in
    transformers: a second run into it passes the check."""
    out = tmp_path / "out"
    shutil.copytree(tiny_vlm_dir("qwen2_5_vl"), out)
    (out / "training_args.bin").write_bytes(b"saved by Trainer.save_model")
    assert main(["--model_name_or_path", str(tiny_vlm_dir("qwen2_5_vl")), "--dataset_path", str(prepared_aokvqa_dir),
                 "--output_dir", str(out), "--dry_run"]) == 0, capsys.readouterr().err


def test_the_trainer_refuses_the_model_folder_as_output_dir_before_it_loads(model_copy, grpo_train_dataset, tmp_path,
                                                                            monkeypatch):
    from test_trainer import make_args, spread_reward
    from trl import GRPOTrainer

    from trl_mdi.trainer import MDIGRPOTrainer

    loads = []
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: loads.append(a))
    before = digests(model_copy)
    with pytest.raises(ValueError, match=r"is the model's own folder: the run's saves would overwrite"):
        MDIGRPOTrainer(str(model_copy), reward_funcs=[spread_reward], args=make_args(tmp_path,
                       output_dir=str(model_copy)), train_dataset=grpo_train_dataset)
    assert loads == [] and digests(model_copy) == before


# ---------------------------------------------------------------------------------------------------- the prep
@pytest.fixture
def flat_source(tmp_path) -> Path:
    """A-OKVQA in the Hub schema as plain train.parquet / validation.parquet files (a layout users keep)."""
    from fixtures.synthetic import write_synthetic_aokvqa

    src = tmp_path / "src"
    write_synthetic_aokvqa(str(src), n_train=8, n_validation=4, n_test=0, seed=0, num_shards=1)
    for shard in (src / "data").iterdir():
        shard.rename(src / f"{shard.name.split('-')[0]}.parquet")
    (src / "data").rmdir()
    return src


@pytest.mark.parametrize("out", ["the source folder", "a folder inside the source", "the source file's folder"])
def test_the_prep_never_writes_into_its_source(flat_source, tmp_path, out):
    from data_prep.prepare_aokvqa_for_trl import main as prep_main

    before = digests(tmp_path)
    source = str(flat_source / "train.parquet") if out == "the source file's folder" else str(flat_source)
    out_dir = flat_source / "prepared" if out == "a folder inside the source" else flat_source
    with pytest.raises(OutDirNotEmptyError, match="the prep never writes into its source"):
        prepare_aokvqa(source, str(out_dir), overwrite=True, log=lambda *a: None)
    assert prep_main(["--dataset_path", source, "--out_dir", str(out_dir), "--overwrite"]) == 2
    assert digests(tmp_path) == before and not (flat_source / "prepared").exists()


def test_overwrite_replaces_only_the_preps_own_outputs(flat_source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.parquet").write_bytes(b"the user's own train.parquet")
    with pytest.raises(OutDirNotEmptyError, match=r"holds train.parquet, which this script did not write there"):
        prepare_aokvqa(str(flat_source), str(out), overwrite=True, log=lambda *a: None)
    assert (out / "train.parquet").read_bytes() == b"the user's own train.parquet"
    (out / "train.parquet").unlink()
    prepare_aokvqa(str(flat_source), str(out), overwrite=True, log=lambda *a: None)
    assert marked_outputs(str(out)) == {"train.parquet", "validation.parquet"} and (out / OUTPUT_MARKER).is_file()
    first = digests(out)
    prepare_aokvqa(str(flat_source), str(out), overwrite=True, splits=["train"], log=lambda *a: None)  # its own: fine
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "train.parquet"]  # its stale validation went
    assert digests(out)["train.parquet"] == first["train.parquet"]
