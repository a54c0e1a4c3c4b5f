"""Save and resume several VLM families under DeepSpeed ZeRO-3, in ONE 2-process launch: the parameters a resume
starts from, gathered from the shards, against those its checkpoint was saved with.

argv: out_jsonl model_dir [model_dir ...]. Per model: run 1 trains 1 step (a real learning rate, so the weights
leave the base model's) and saves checkpoint-1; the main process then overwrites checkpoint-1/model.safetensors with
perturbed weights (the consolidated copy a ZeRO-3 resume must not read: it resumes from DeepSpeed's own
``global_step1/`` shards); run 2 resumes from checkpoint-1. Each rank appends one JSON record per model: the digest of
the full parameters of the base model, at the end of run 1 (what checkpoint-1 holds) and at the start of run 2
(on_train_begin, after the checkpoint loaded); the test reads the perturbed file's itself.
"""

import json
import sys
from pathlib import Path

from trl import GRPOConfig

from trl_mdi import MDIGRPOTrainer

# Run as a script, so tests/dist/ is on sys.path and not the checkout, whose fixtures/ folder is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fixtures.testing import DigestAtTrainBegin, parameter_digest, perturb_weight_files, zen_image_dataset  # noqa: E402


def spread_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]


def main():
    out_path, model_dirs = sys.argv[1], sys.argv[2:]
    data = zen_image_dataset(16)
    for i, model_dir in enumerate(model_dirs):
        out_dir = Path(out_path).parent / f"run{i}"

        def trainer(max_steps):
            args = GRPOConfig(output_dir=str(out_dir), bf16=False, report_to="none", per_device_train_batch_size=2,
                              num_generations=2, max_completion_length=4, max_steps=max_steps, logging_steps=1,
                              save_strategy="steps", save_steps=1, seed=0, learning_rate=1e-2, disable_tqdm=True,
                              ddp_backend="gloo", shuffle_dataset=False)
            t = MDIGRPOTrainer(model_dir, reward_funcs=spread_reward, args=args, train_dataset=data)
            t.add_callback(start := DigestAtTrainBegin())
            return t, start

        first, start = trainer(1)
        first.train()
        base, trained = start.value, parameter_digest(first.accelerator.unwrap_model(first.model))
        acc = first.accelerator
        first.run_lock and first.run_lock.release()
        del first
        checkpoint = out_dir / "checkpoint-1"
        if acc.is_main_process:
            perturb_weight_files(checkpoint, seed=7)
        acc.wait_for_everyone()
        second, start = trainer(2)
        second.train(resume_from_checkpoint=str(checkpoint))
        record = {"model": model_dir, "rank": acc.process_index, "distributed_type": str(acc.distributed_type),
                  "base": base, "trained": trained, "resumed": start.value,
                  "global_step": second.state.global_step}
        with open(out_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        second.run_lock and second.run_lock.release()
        del second
        acc.free_memory()


if __name__ == "__main__":
    main()
