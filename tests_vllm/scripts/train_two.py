"""Two GRPO runs with vLLM generating, under ``accelerate launch`` with 2 CPU processes (one colocated engine each).

argv: model_dir out_dir config_json (GRPOConfig overrides, plus ``rows``: the dataset's size, default 8, and ``runs``:
which of "stock" and "metrics_on" to train, default both). In one launch (processes and imports paid once), each rank
trains stock ``GRPOTrainer`` with the trainer's prompt fix (``PromptFixedGRPOTrainer``), then ``MDIGRPOTrainer`` with
attention metrics and reliance signals on, recording what ``test_colocate.record_run`` records plus the rewards it
scored, the advantages TRL computed from them, and the inputs and log-probs of every no-grad policy forward. Each rank
saves its records to ``out_dir/rank<i>.pt`` for tests_vllm/test_two_processes.py to compare.

Settings shared with the one-process tests (``test_colocate.common_args``), plus what 2 CPU processes need:
``use_cpu=True`` and ``ddp_backend="gloo"``. Without ``use_cpu`` on a machine with no GPU, accelerate builds a
2-process gloo group yet reports ``DistributedType.NO``, so ``gather`` returns the local rows and TRL slices rank 1's
advantages out of a batch that holds only rank 0's share (the trainer refuses that launch:
tests_vllm/test_two_processes.py).
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests_vllm")]  # the checkout's fixtures/, and test_colocate's helpers

# What tests_vllm/conftest.py sets (a launch from the test inherits it; set here for a launch by hand), before vLLM or
# an HF library is imported.
for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(key, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from fixtures import vllm_cpu  # noqa: E402

vllm_cpu.set_env()

import test_colocate  # noqa: E402
import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fixtures.testing import zen_image_dataset  # noqa: E402
from fixtures.vllm_baseline import PromptFixedGRPOTrainer  # noqa: E402
from trl_mdi.trainer import MDIGRPOTrainer  # noqa: E402


def main():
    model_dir, out_dir, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    vllm_cpu.install()
    rewards: list[list[float]] = []  # what the reward scored on this rank, per generation batch
    advantages: list[list[float]] = []  # TRL's advantages for this rank's rows, per generation batch

    score = test_colocate.spread_reward

    def spread_reward(completions, **kwargs):
        scores = score(completions, **kwargs)
        rewards.append(scores)
        return scores

    spread_reward.__name__ = "spread_reward"
    test_colocate.spread_reward = spread_reward  # record_run passes the module's reward function

    forwards: list[list[dict]] = []  # this rank's no-grad policy forwards per generation batch: inputs and log-probs
    gen_and_score = GRPOTrainer._generate_and_score_completions

    def gen(trainer, inputs):
        forwards.append([])
        output = gen_and_score(trainer, inputs)
        advantages.append(output["advantages"].tolist())
        return output

    logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies

    def fwd(trainer, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        out = logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        if not torch.is_grad_enabled() and model is trainer.model and forwards:
            forwards[-1].append({
                "input_ids": input_ids.clone(), "attention_mask": attention_mask.clone(), "logits_to_keep": logits_to_keep,
                "multimodal": {k: v.clone() for k, v in kw.items() if k in test_colocate.MODEL_FIELDS and v is not None},
                "logps": out[0].detach().clone()})
        return out

    GRPOTrainer._generate_and_score_completions = gen  # record_run wraps these two
    GRPOTrainer._get_per_token_logps_and_entropies = fwd
    monkeypatch = test_colocate.pytest.MonkeyPatch()
    dataset = zen_image_dataset(overrides.pop("rows", 8))
    records = {}
    for name in overrides.pop("runs", ["stock", "metrics_on"]):
        run_dir = out_dir / name
        common = {**test_colocate.common_args(run_dir), "ddp_backend": "gloo", **overrides}
        if name == "stock":
            args, cls = GRPOConfig(**common), PromptFixedGRPOTrainer
        else:
            args, cls = test_colocate.mdi_args(run_dir, **{**common, "compute_attention_metrics": True,
                                                                  "reliance_signals": True}), MDIGRPOTrainer
        rewards.clear()
        advantages.clear()
        forwards.clear()
        rec = test_colocate.record_run(monkeypatch, cls, model_dir, args, dataset)
        records[name] = {"rec": rec, "rewards": list(rewards), "advantages": list(advantages),
                         "forwards": list(forwards)}
    state = launch_state()
    torch.save({**state, "runs": records}, out_dir / f"rank{state['rank']}.pt")
    # Leave the gloo group together, as the entry point does (Trainer.end): a rank that exits with the group alive can
    # abort in gloo's teardown (SIGABRT, "terminate called without an active exception") on a loaded machine.
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    PartialState().destroy_process_group()


def launch_state() -> dict:
    """This process's view of the launch, as accelerate reports it."""
    from accelerate import PartialState

    st = PartialState()
    return {"rank": st.process_index, "world_size": st.num_processes, "distributed_type": str(st.distributed_type)}


if __name__ == "__main__":  # vLLM starts worker machinery: the guard keeps a re-import from training again
    main()
