"""Checkpoints in FSDP's layouts are recognised by the resume checks (``trl_mdi.checkpoints``): the sharded state dict
(``pytorch_model_fsdp_0/`` and ``optimizer_0/``, torch.distributed.checkpoint folders, as accelerate writes them under
``fsdp_state_dict_type: SHARDED_STATE_DICT``, ``accelerate_configs/fsdp2.yaml``) and the full one
(``pytorch_model_fsdp.bin``, ``optimizer.bin``). The shard folders are written here by torch.distributed.checkpoint
itself, in one process: the same files (an index, ``.metadata``, and ``__<rank>_0.distcp`` shards) a 2-process save
writes, one shard fewer."""

import json
import warnings

import pytest
import torch

from trl_mdi.checkpoints import CheckpointError, describe, resolve_resume, resume_problems


def fsdp_checkpoint(folder, sharded: bool = True):
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    folder.mkdir(parents=True)
    if sharded:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group": a one-process save, as intended here
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"))
            dcp.save({"optimizer": optimizer.state_dict()}, checkpoint_id=str(folder / "optimizer_0"))
    else:
        torch.save(model.state_dict(), folder / "pytorch_model_fsdp.bin")
        torch.save(optimizer.state_dict(), folder / "optimizer.bin")
    torch.save({"lr": 1.0}, folder / "scheduler.pt")
    torch.save({"python": 0}, folder / "rng_state_0.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    return folder


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_an_fsdp_checkpoint_is_whole(tmp_path, sharded):
    folder = fsdp_checkpoint(tmp_path / "out" / "checkpoint-4", sharded)
    assert resume_problems(folder) == []
    assert resolve_resume(True, tmp_path / "out") == (str(folder), [])


def test_what_a_sharded_fsdp_checkpoint_lacks_is_named(tmp_path):
    folder = fsdp_checkpoint(tmp_path / "checkpoint-4")
    shard = next((folder / "pytorch_model_fsdp_0").glob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lacks pytorch_model_fsdp_0/{shard.name}"):
        resolve_resume(str(folder), tmp_path)
    (folder / "optimizer_0" / ".metadata").unlink()
    assert "optimizer_0/.metadata" in describe(resume_problems(folder))
    (folder / "optimizer_0" / ".metadata").write_bytes(b"\x80not a pickle")
    assert any(p.name == "optimizer_0/.metadata" and p.cut for p in resume_problems(folder))


def test_a_sharded_fsdp_checkpoint_without_its_optimizer_may_restart_it(tmp_path):
    import shutil

    folder = fsdp_checkpoint(tmp_path / "checkpoint-4")
    shutil.rmtree(folder / "optimizer_0")
    problems = resume_problems(folder)
    assert [p.optional for p in problems] == [True] and "optimizer_0/ or optimizer.bin" in problems[0].name
    checkpoint, notes = resolve_resume(str(folder), tmp_path, allow_partial=True)
    assert checkpoint == str(folder) and notes
