"""A few MDIGRPOTrainer steps under `accelerate launch` with 2 CPU processes (DDP or ZeRO-3).

argv: model_dir data_parquet out_jsonl config_json. Each rank appends one JSON record: its view of the world,
how many no-grad policy forwards it ran per generation batch, how many rollouts it measured, the digest of the full
parameters training started from (after a resume's checkpoint loaded), and (rank 0) the logged metrics.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from datasets import load_dataset
from trl import GRPOTrainer

from trl_mdi.config import MDIGRPOConfig
from trl_mdi.data import to_conversational
from trl_mdi.trainer import MDIGRPOTrainer

# Run as a script, so tests/dist/ is on sys.path and not the checkout, whose fixtures/ folder is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fixtures.testing import DigestAtTrainBegin, parameter_digest  # noqa: E402


def spread_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]


def main():
    model_dir, data_path, out_path, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    forwards: list[int] = []
    measured: list[int] = []
    # Whether each generation batch / training micro-batch of this rank held an image, in order (ranks step together,
    # so index i is the same batch on every rank).
    generation_has_image: list[bool] = []
    micro_batch_has_image: list[bool] = []
    original_gen = GRPOTrainer._generate_and_score_completions
    original_fwd = GRPOTrainer._get_per_token_logps_and_entropies
    original_loss = GRPOTrainer.compute_loss

    def gen(trainer, inputs):
        forwards.append(0)
        generation_has_image.append(any(x.get("image") is not None or bool(x.get("images")) for x in inputs))
        out = original_gen(trainer, inputs)
        return out

    def loss(trainer, model, inputs, *args, **kwargs):
        pixels = inputs.get("pixel_values")
        micro_batch_has_image.append(pixels is not None and pixels.numel() > 0)
        return original_loss(trainer, model, inputs, *args, **kwargs)

    def fwd(trainer, model, *args, **kwargs):
        if not torch.is_grad_enabled() and model is trainer.model and forwards:
            forwards[-1] += 1
        return original_fwd(trainer, model, *args, **kwargs)

    GRPOTrainer._generate_and_score_completions = gen
    GRPOTrainer._get_per_token_logps_and_entropies = fwd
    GRPOTrainer.compute_loss = loss

    group_scores: list[list] = []
    mdi_seen: list[list] = []  # each generation batch's local MDI (None without an image), as the rewards got it

    def recording_reward(completions, mdi, mdi_group_score, **kwargs):
        time.sleep(slow)  # lets a test kill the run at a known point
        measured.append(sum(m is not None for m in mdi))
        group_scores.append(list(mdi_group_score))
        mdi_seen.append(list(mdi))
        return [0.0] * len(completions)

    ds = load_dataset("parquet", data_files=data_path, split="train").map(to_conversational)
    drop_every = overrides.pop("drop_image_every", 0)
    limit_rows = overrides.pop("limit_rows", None)
    resume = overrides.pop("resume_from_checkpoint", None)
    slow = overrides.pop("slow_reward_seconds", 0.0)
    no_vision_pass = overrides.pop("no_vision_pass", False)
    pid_dir = overrides.pop("pid_dir", None)
    if pid_dir:  # lets a test signal one rank's process
        Path(pid_dir).mkdir(parents=True, exist_ok=True)
        (Path(pid_dir) / f"rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    if limit_rows:
        ds = ds.select(range(limit_rows))
    text_only_rows = set(overrides.pop("text_only_rows", ()))
    if text_only_rows:  # these rows lose their image: with shuffle_dataset=False, a chosen layout across ranks
        ds = ds.map(lambda ex, i: {"image": None if i in text_only_rows else ex["image"]}, with_indices=True)
    if drop_every:
        # Some prompts lose their image, so ranks see different mixes.
        ds = ds.map(lambda ex, i: {"image": None if i % drop_every == drop_every - 1 else ex["image"]}, with_indices=True)
    out_dir = overrides.pop("output_dir")
    kwargs = dict(
        output_dir=out_dir, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no", seed=0,
        learning_rate=1e-3, disable_tqdm=True, ddp_backend="gloo",
        rollout_log_path=out_dir + "/logs/rollouts.md", attention_diag_log_path=out_dir + "/logs/attention.md",
        # Off (MDIGRPOConfig's default is on): a random tiny model never stops within 6 tokens, so every completion
        # would leave the loss and nothing would train.
        mask_truncated_completions=False,
    )
    kwargs.update(overrides)
    args = MDIGRPOConfig(**kwargs)
    trainer = MDIGRPOTrainer(model_dir, reward_funcs=["mdi_balance", "mdi_group", spread_reward, recording_reward],
                             args=args, train_dataset=ds)
    if no_vision_pass and trainer.vision_pass is not None:
        trainer.vision_pass.remove()
        trainer.vision_pass = None
    trainer.add_callback(at_start := DigestAtTrainBegin())
    trainer.train(resume_from_checkpoint=resume)
    acc = trainer.accelerator
    record = {
        "rank": acc.process_index,
        "world_size": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "forwards_per_generation": forwards,
        "generation_has_image": generation_has_image,
        "micro_batch_has_image": micro_batch_has_image,
        "measured_rows": measured,
        "group_scores": group_scores,
        "mdi": mdi_seen,
        "logs": [h for h in trainer.state.log_history if "loss" in h] if acc.is_main_process else [],
    }
    record["dummy_vision_passes"] = trainer.vision_pass.count if trainer.vision_pass is not None else None
    record["param_digest"] = parameter_digest(acc.unwrap_model(trainer.model))
    record["global_step"] = trainer.state.global_step
    record["start_digest"] = at_start.value  # the full parameters training started from: a resume's checkpoint's
    ds_params = [p for p in trainer.model.parameters() if hasattr(p, "ds_numel")]
    if ds_params:
        record["local_param_fraction"] = sum(p.ds_tensor.numel() for p in ds_params) / sum(p.ds_numel for p in ds_params)
    with open(out_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    trainer.end()  # destroys the group, as the entry point does: a rank exiting with it alive can abort in gloo's teardown


if __name__ == "__main__":
    main()
