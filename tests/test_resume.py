"""A resume restores exactly what was saved (issue 42, item 1): the parameters, not the step count.

transformers' Trainer reloaded a checkpoint's whole-model weights with ``load_state_dict(strict=False)`` and no key
conversion, while ``save_pretrained`` writes the Hub layout: Qwen2.5-VL kept 68 of its 69 tensors at the base
model's values, LLaVA 1.5 all 73, behind a "missing keys" warning. Each test here perturbs a saved checkpoint (so
that "restored" cannot pass by accident: the perturbed values are nobody's but the checkpoint's), resumes at a
learning rate of ~0 and compares every parameter with the checkpoint's as ``from_pretrained`` reads it. DDP and
ZeRO-3: tests/test_kill_resume.py, tests/test_trainer_distributed.py.
"""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, PreTrainedModel, TrainerCallback

from fixtures.testing import perturb_weight_files
from trl_mdi.checkpoints import MARKER, CheckpointError, load_full_weights
from trl_mdi.config import MDIGRPOConfig
from trl_mdi.trainer import MDIGRPOTrainer

TINY_LR = 1e-30  # Adam moves a weight by about the learning rate: far below float32's resolution at 0.1


def spread_reward(completions, **kwargs):
    return [float(len(str(c)) % 7) for c in completions]


def make_args(out, **overrides):
    kw = dict(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=2,
              num_generations=2, max_completion_length=4, max_steps=1, logging_steps=1, save_strategy="steps",
              save_steps=1, seed=0, learning_rate=TINY_LR, disable_tqdm=True, realtime_rollout_logging=False,
              compute_attention_metrics=False)
    kw.update(overrides)
    return MDIGRPOConfig(**kw)


def differing(ours: dict, reference: dict) -> list[str]:
    """Names of ``reference``'s tensors that ``ours`` lacks or holds other values for (well below the 0.1 noise)."""
    return [k for k, v in reference.items()
            if k not in ours or not torch.allclose(ours[k].detach().cpu().float(), v.float(), atol=1e-6, rtol=0)]


def train_and_save(model_dir, out, data, **overrides):
    """One step at a learning rate of ~0, checkpoint-1 saved; the trainer's lock released for the next run."""
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(out, **overrides),
                             train_dataset=data)
    trainer.train()
    trainer.run_lock.release()
    return out / "checkpoint-1"


def resume(model_dir, out, data, checkpoint, **overrides):
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(out, max_steps=2, save_strategy="no", **overrides), train_dataset=data)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 2
    return trainer


def assert_restored(trainer, checkpoint, model_dir):
    reference = AutoModelForImageTextToText.from_pretrained(checkpoint).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()
    assert not set(differing(base, reference)) ^ {k for k, v in reference.items() if v.is_floating_point()}, \
        "the perturbation did not reach every tensor"
    wrong = differing(trainer.model.state_dict(), reference)
    assert not wrong, f"{len(wrong)} of {len(reference)} tensors are not the checkpoint's after the resume: {wrong[:5]}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "llava", "gemma3"])  # gemma3: hybrid sliding-window / full attention
def test_a_resume_restores_the_checkpoints_parameters(arch, tiny_vlm_dir, grpo_train_dataset, tmp_path):
    """One process, the documented recipe (``resume_from_checkpoint``): every parameter is the checkpoint's (before:
    Qwen2.5-VL 1 of 69, LLaVA 1.5 and Gemma 3 none)."""
    model_dir, out = tiny_vlm_dir(arch), tmp_path / "out"
    checkpoint = train_and_save(model_dir, out, grpo_train_dataset)
    perturb_weight_files(checkpoint)
    assert_restored(resume(model_dir, out, grpo_train_dataset, checkpoint), checkpoint, model_dir)


@pytest.mark.slow
def test_a_sharded_checkpoint_is_restored_and_one_missing_a_tensor_is_refused(tiny_vlm_dir, grpo_train_dataset,
                                                                              tmp_path, monkeypatch):
    """A save in shards (a model above ``save_pretrained``'s max_shard_size: here 20 KB) resumes whole; a checkpoint
    that lacks a tensor (no marker: plain TRL's, judged by its files) is refused in one line naming it, where
    transformers warned and went on with the tensor at its current value."""
    save = PreTrainedModel.save_pretrained
    monkeypatch.setattr(PreTrainedModel, "save_pretrained",
                        lambda self, *a, **k: save(self, *a, **{**k, "max_shard_size": "20KB"}))
    model_dir, out = tiny_vlm_dir("qwen2_5_vl"), tmp_path / "out"
    checkpoint = train_and_save(model_dir, out, grpo_train_dataset)
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    assert len(shards) > 2 and (checkpoint / "model.safetensors.index.json").is_file()
    perturb_weight_files(checkpoint)
    assert_restored(resume(model_dir, out, grpo_train_dataset, checkpoint), checkpoint, model_dir)

    tensors = load_file(shards[1])
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, shards[1], metadata={"format": "pt"})
    (checkpoint / MARKER).unlink()
    with pytest.raises(CheckpointError) as e:
        resume(model_dir, out, grpo_train_dataset, checkpoint)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"the weights in {checkpoint} do not fit this model "
                                                      "(Qwen2_5_VLForConditionalGeneration")
    assert "1 of the model's 69 tensors found no weights in it (" in message and "resume with the model" in message


@pytest.mark.slow
def test_a_lora_resume_restores_the_adapter_and_refuses_one_missing_a_tensor(tiny_vlm_dir, grpo_train_dataset,
                                                                            tmp_path):
    """LoRA: PEFT loads the adapter (right: tested here against ``PeftModel.from_pretrained``); an adapter file that
    lacks a tensor is refused in one line (PEFT only warned, and the tensor trained on from its fresh init)."""
    from peft import LoraConfig, PeftModel

    lora = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model_dir, out = tiny_vlm_dir("qwen2_5_vl"), tmp_path / "out"
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=make_args(out),
                             train_dataset=grpo_train_dataset, **lora)
    trainer.train()
    trainer.run_lock.release()
    checkpoint = out / "checkpoint-1"
    perturb_weight_files(checkpoint, pattern="adapter_model.safetensors")
    resumed = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(out, max_steps=2, save_strategy="no"), train_dataset=grpo_train_dataset,
                             **lora)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model_dir), checkpoint)
    reference = {k: v for k, v in reference.state_dict().items() if "lora_" in k}
    assert len(reference) == 12 and not differing(resumed.model.state_dict(), reference)
    resumed.run_lock.release()

    path = checkpoint / "adapter_model.safetensors"
    tensors = load_file(path)
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, path, metadata={"format": "pt"})
    (checkpoint / MARKER).unlink()
    again = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                           args=make_args(out, max_steps=2, save_strategy="no"), train_dataset=grpo_train_dataset,
                           **lora)
    with pytest.raises(CheckpointError) as e:
        again.train(resume_from_checkpoint=str(checkpoint))
    assert "\n" not in str(e.value) and str(e.value).startswith(
        f"the LoRA adapter in {checkpoint} does not fit this model's adapter: 1 of the adapter's 12 tensors are not "
        f"in it ({dropped})")


@pytest.mark.slow
def test_load_best_model_at_end_restores_the_best_checkpoints_parameters(tiny_vlm_dir, grpo_train_dataset, tmp_path):
    """``load_best_model_at_end``: the model after training is the best checkpoint's (before: the same fault as a
    resume's, the last step's weights kept for nearly every tensor). Each checkpoint is perturbed as it is saved, so
    that the best one differs from the weights in memory."""

    class PerturbEachSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            perturb_weight_files(tmp_path / "out" / f"checkpoint-{state.global_step}", seed=state.global_step)

    model_dir = tiny_vlm_dir("qwen2_5_vl")
    args = make_args(tmp_path / "out", max_steps=2, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                     metric_for_best_model="reward", per_device_eval_batch_size=2)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=args,
                             train_dataset=grpo_train_dataset, eval_dataset=grpo_train_dataset.select(range(2)))
    trainer.add_callback(PerturbEachSave())
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert re.search(r"checkpoint-[12]$", best), best
    assert_restored(trainer, best, model_dir)


# ------------------------------------------------------------------------------------------------ every family
@pytest.fixture(scope="module")
def all_families(tiny_vlm_dir):
    from fixtures.tiny import TINY_ARCHS

    return {arch: tiny_vlm_dir(arch) for arch in TINY_ARCHS}


@pytest.mark.slow
def test_every_family_loads_its_saved_layout_exactly_and_saves_it_unchanged(all_families, tmp_path):
    """``load_full_weights`` on every tiny family: a model saved by ``save_pretrained`` (the Hub layout the Trainer
    writes: renamed prefixes, Qwen3.5-MoE's experts split per expert) loads into the base model as ``from_pretrained``
    reads it, every tensor; the model's own tensors stay the same objects (an optimizer holds them), tied weights stay
    tied, and a save afterwards writes the same layout as before (vLLM and the Hub read it)."""
    failures = {}
    for arch, model_dir in all_families.items():
        trained = AutoModelForImageTextToText.from_pretrained(model_dir)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))
        trained.save_pretrained(tmp_path / arch / "saved")
        model = AutoModelForImageTextToText.from_pretrained(model_dir)
        own = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
        load_full_weights(model, tmp_path / arch / "saved")
        wrong = differing(model.state_dict(), trained.state_dict())
        moved = [n for n, p in model.named_parameters(remove_duplicate=False) if p is not own[n]]
        model.save_pretrained(tmp_path / arch / "again")
        layout = [set(load_file(f).keys()) for d in ("saved", "again")
                  for f in [sorted((tmp_path / arch / d).glob("*.safetensors"))] for f in f]
        if wrong or moved or layout[0] != layout[1]:
            failures[arch] = (wrong[:3], len(wrong), moved[:3], layout[0] ^ layout[1])
    assert not failures, failures


def test_a_checkpoint_of_another_model_is_refused_in_one_line(all_families, tmp_path):
    """LLaVA 1.5's weights into Qwen2.5-VL: refused, naming both classes and what did not fit (transformers loaded
    nothing and said so only in a warning)."""
    llava = AutoModelForImageTextToText.from_pretrained(all_families["llava"])
    llava.save_pretrained(tmp_path / "llava")
    qwen = AutoModelForImageTextToText.from_pretrained(all_families["qwen2_5_vl"])
    with pytest.raises(CheckpointError) as e:
        load_full_weights(qwen, tmp_path / "llava")
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"the weights in {tmp_path / 'llava'} do not fit this model (Qwen2_5_VLForConditionalGeneration; the "
        "checkpoint was saved from LlavaForConditionalGeneration): ")
    assert "tensors found no weights in it" in message and "fit no tensor of the model" in message
    assert json.loads((tmp_path / "llava" / "config.json").read_text())["model_type"] == "llava"


# ------------------------------------------------------------------------------------------------ resume settings
@pytest.mark.slow
def test_a_resume_with_other_settings_is_refused_before_its_weights_load_and_one_at_its_end_does_nothing(
        tiny_vlm_dir, grpo_train_dataset, tmp_path, monkeypatch):
    """Library use (issue 42, item 3). A changed num_generations was accepted (the epoch then ran backwards), and a
    run already at max_steps trained one more step and saved a checkpoint past its end. Now the first is one line
    naming the setting and both values, before the checkpoint's weights load; the second trains nothing, says so,
    and leaves the model holding the checkpoint's weights (a script's save_model then writes those)."""
    import trl_mdi.checkpoints as ck

    model_dir, out = tiny_vlm_dir("qwen2_5_vl"), tmp_path / "out"
    checkpoint = train_and_save(model_dir, out, grpo_train_dataset)
    perturb_weight_files(checkpoint)
    assert json.loads((checkpoint / MARKER).read_text())["resume"]["num_generations"] == 2
    loads = []
    monkeypatch.setattr(ck, "load_full_weights", lambda *a: (loads.append(a), load_full_weights(*a))[1])

    other = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], train_dataset=grpo_train_dataset,
                           args=make_args(out, max_steps=2, num_generations=4, per_device_train_batch_size=4))
    with pytest.raises(CheckpointError) as e:
        other.train(resume_from_checkpoint=str(checkpoint))
    assert str(e.value) == (
        f"cannot resume from {checkpoint}: num_generations: 2 in the run that saved {checkpoint}, 4 in this one. "
        f"Resume with num_generations 2, or start a new run from its weights (--model_name_or_path {checkpoint}, "
        "without --resume_from_checkpoint)")
    assert loads == [] and other.state.global_step == 0
    other.run_lock.release()

    done = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], train_dataset=grpo_train_dataset,
                          args=make_args(out, max_steps=1))
    result = done.train(resume_from_checkpoint=str(checkpoint))
    assert result.global_step == 1 and done.state.global_step == 0 and len(loads) == 1
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    reference = AutoModelForImageTextToText.from_pretrained(checkpoint).state_dict()
    assert not differing(done.model.state_dict(), reference)


@pytest.mark.slow
def test_the_entry_point_checks_a_resume_before_any_weight_loads(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path,
                                                                   capsys, monkeypatch):
    """The entry point: after a real run saved checkpoint-1, each setting a resume must keep, changed, is one line
    naming it, both values and the way out, exit status 2, with no trainer built (so no weight loaded); a resume
    already at max_steps prints that there is nothing to train and exits 0 (before: a different model failed after
    the weights loaded, with an optimizer-group traceback; a changed num_generations or reward stack trained on)."""
    from trl import GRPOTrainer

    from trl_mdi.cli.command import main

    out = tmp_path / "out"
    flags = ["--dataset_path", prepared_aokvqa_dir, "--output_dir", out, "--max_steps", "1", "--save_steps", "1",
             "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
             "--report_to", "none", "--realtime_rollout_logging", "false"]
    qwen, llava = tiny_vlm_dir("qwen2_5_vl"), tiny_vlm_dir("llava")
    assert main([str(f) for f in ["--model_name_or_path", qwen, *flags]]) == 0
    checkpoint = out / "checkpoint-1"
    capsys.readouterr()
    built = []
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: built.append(a))

    def run(model, *more):
        code = main([str(f) for f in ["--model_name_or_path", model, *flags, "--max_steps", "2",
                                      "--resume_from_checkpoint", "true", *more]])
        captured = capsys.readouterr()
        return code, [line for line in captured.err.splitlines() if line.startswith("error")], captured.out

    prefix = f"error: cannot resume from {checkpoint}: "
    fresh = (f"start a new run from its weights (--model_name_or_path {checkpoint}, without "
             "--resume_from_checkpoint)")
    for model, more, line in [
        (qwen, ["--num_generations", "2"], f"num_generations: 4 in the run that saved {checkpoint}, 2 in this one. "
                                           f"Resume with num_generations 4, or {fresh}"),
        (llava, [], f"model: the run that saved it trained a qwen2_5_vl model ({qwen}), this one loads a llava "
                    f"({llava}). Resume with the model it was saved from (--model_name_or_path {qwen})"),
        (qwen, ["--per_device_train_batch_size", "8"],
         "batch layout: per_device_train_batch_size 4 x gradient_accumulation_steps 1 x 1 processes (4 rollouts per "
         "step, steps_per_generation 1, num_iterations 1) in the run that saved "
         f"{checkpoint}, per_device_train_batch_size 8 x gradient_accumulation_steps 1 x 1 processes (8 rollouts per "
         f"step, steps_per_generation 1, num_iterations 1) in this one. Resume with the saved layout, or {fresh}"),
        (qwen, ["--reward_weights", "1", "1", "1"],
         f"reward stack: mc_idx x4, think_format x1, mdi_balance x1 in the run that saved {checkpoint}, mc_idx x1, "
         "think_format x1, mdi_balance x1 in this one. Resume with --reward_funcs mc_idx think_format mdi_balance "
         f"--reward_weights 4 1 1, or {fresh}"),
    ]:
        code, errors, _ = run(model, *more)
        assert (code, errors) == (2, [prefix + line]), (more, errors)
    code, errors, printed = run(qwen, "--max_steps", "1")
    assert code == 0 and not errors and f"nothing to train: {checkpoint} is at step 1 and max_steps is 1." in printed
    assert built == [] and sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]


def test_the_number_of_processes_matters_where_the_checkpoint_is_per_process(tmp_path):
    """DDP: 2 processes x 4 rows may resume as 4 x 2 (the same rollouts per step and per generation batch: the same
    data order and update). DeepSpeed keeps its optimizer and weight shards per process: refused, naming both."""
    from types import SimpleNamespace

    from trl_mdi.checkpoints import check_resume_matches, mark_complete, resume_record

    config = SimpleNamespace(model_type="m", _name_or_path="m", to_dict=lambda: {"hidden_size": 8})

    def record(per_device, processes, deepspeed):
        args = SimpleNamespace(num_generations=4, per_device_train_batch_size=per_device,
                               gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1)
        return resume_record(config, args, processes=processes, deepspeed=deepspeed, reward_names=["r"],
                             reward_weights=None)

    for deepspeed in (False, True):
        folder = tmp_path / f"ds{deepspeed}" / "checkpoint-2"
        folder.mkdir(parents=True)
        mark_complete(folder, resume=record(4, 2, deepspeed))
        check_resume_matches(folder, record(4, 2, deepspeed))
        if not deepspeed:
            check_resume_matches(folder, record(2, 4, deepspeed))
            continue
        with pytest.raises(CheckpointError) as e:
            check_resume_matches(folder, record(2, 4, deepspeed))
        assert "x 2 processes (8 rollouts per step" in str(e.value) and "x 4 processes (8 rollouts per step" in str(
            e.value) and "(DeepSpeed saves its optimizer and weights per process)" in str(e.value)
