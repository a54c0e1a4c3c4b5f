"""Several VLM families, one after another, each trained 2 steps by MDIGRPOTrainer in ONE 2-process launch.

argv: out_jsonl model_dir [model_dir ...]. A plain trl.GRPOConfig (as a TRL user's script has it), the default
attention settings, a zen-image-like dataset whose prompts alternate one image / no image, unshuffled, one prompt
per process: every step rank 0 has an image and rank 1 none, so rank 1 joins the vision tower's ZeRO-3 gathers
through the dummy vision pass (a family that takes no prompt without an image, PaliGemma, gets one on both). Each rank appends one JSON record per model: world view, how much of the weights it
holds (ZeRO-3 sharding), its dummy passes, and (rank 0) the logged metrics. One launch for all families keeps the
suite fast: importing trl + transformers and starting DeepSpeed cost more than the training.
"""

import json
import sys
from pathlib import Path

from transformers import AutoConfig, AutoModelForImageTextToText
from trl import GRPOConfig

from trl_mdi import MDIGRPOTrainer
from trl_mdi.attention.model_facts import ZERO3_LOADING_PROBLEMS, model_facts

# Run as a script, so tests/dist/ is on sys.path and not the checkout, whose fixtures/ folder is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fixtures.testing import zen_image_dataset  # noqa: E402


def spread_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]


def main():
    out_path, model_dirs = sys.argv[1], sys.argv[2:]
    # Families transformers cannot load through its ZeRO-3 path (model_facts.ZERO3_LOADING_PROBLEMS: the trainer refuses
    # them by path, naming this fix) are loaded first, before any GRPOConfig turns ZeRO-3 on, and passed as objects.
    preloaded = {d: AutoModelForImageTextToText.from_pretrained(d) for d in model_dirs
                 if AutoConfig.from_pretrained(d).model_type in ZERO3_LOADING_PROBLEMS}
    mixed = zen_image_dataset(16, images_per_row=[1, 0])
    # A family that takes no prompt without an image (PaliGemma) gets an image on both processes: no dummy pass.
    with_images = zen_image_dataset(16, images_per_row=[1])
    for i, model_dir in enumerate(model_dirs):
        data = with_images if model_facts(AutoConfig.from_pretrained(model_dir)).image_in_every_prompt else mixed
        out_dir = Path(out_path).parent / f"run{i}"
        args = GRPOConfig(output_dir=str(out_dir), bf16=False, report_to="none", per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, max_steps=2, logging_steps=1,
                          save_strategy="no", seed=0, learning_rate=1e-2, disable_tqdm=True, ddp_backend="gloo",
                          shuffle_dataset=False)
        trainer = MDIGRPOTrainer(preloaded.pop(model_dir, model_dir), reward_funcs=spread_reward, args=args,
                                 train_dataset=data)
        trainer.train()
        acc = trainer.accelerator
        record = {"model": model_dir, "rank": acc.process_index, "world_size": acc.num_processes,
                  "distributed_type": str(acc.distributed_type), "placement": str(trainer.run_plan.placement),
                  "dummy_vision_passes": trainer.vision_pass.count if trainer.vision_pass is not None else None,
                  "logs": [h for h in trainer.state.log_history if "loss" in h] if acc.is_main_process else []}
        ds_params = [p for p in trainer.model.parameters() if hasattr(p, "ds_numel")]
        if ds_params:
            record["local_param_fraction"] = (sum(p.ds_tensor.numel() for p in ds_params)
                                              / sum(p.ds_numel for p in ds_params))
        with open(out_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        del trainer
        acc.free_memory()


if __name__ == "__main__":
    main()
