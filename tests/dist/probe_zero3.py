"""Run under `accelerate launch --config_file accelerate_configs/cpu_zero3.yaml` (2 processes).

Each rank measures its own rows through the ZeRO-3 engine (parameters really sharded) and checks them
against eager attention weights from an unsharded copy of the same checkpoint. Writes one JSON line per
rank to the file given as argv[2].
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from transformers import AutoModelForImageTextToText, AutoProcessor

from trl_mdi.attention import image_token_ids, measure_modality_attention

# Run as a script, so tests/dist/ is on sys.path and not the checkout, whose fixtures/ folder is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fixtures.testing import eager_group_masses, grpo_batch, shape_image  # noqa: E402


def main():
    path, out_path = sys.argv[1], sys.argv[2]
    # The unsharded eager reference is loaded before the Accelerator exists, so zero.Init does not apply.
    plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    # Without a GPU, accelerate finds no backend and would report num_processes=1 on both ranks although
    # DeepSpeed runs with world size 2: name gloo explicitly (the trainer does so through ddp_backend).
    PartialState(backend="gloo")
    accelerator = Accelerator()
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)  # zero.Init partitions here
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    # A one-item dataloader only lets accelerate fill the DeepSpeed "auto" batch sizes.
    loader = torch.utils.data.DataLoader([0], batch_size=1)
    engine, _, _ = accelerator.prepare(model, optimizer, loader)
    engine.eval()
    processor = AutoProcessor.from_pretrained(path)
    rank = accelerator.process_index
    # Different rows (and sequence lengths) on each rank: each rank measures its own.
    batch = grpo_batch(
        processor,
        ["What colour is the shape?", "How many shapes?" + " please" * rank],
        [shape_image(56, rank), None if rank == 0 else shape_image(56, 7)],
        [4 + rank, 3],
        seed=rank,
    )
    res = measure_modality_attention(engine, **batch)
    sharded = [p for p in engine.module.parameters() if hasattr(p, "ds_numel")]
    local_fraction = sum(p.ds_tensor.numel() for p in sharded) / max(1, sum(p.ds_numel for p in sharded))

    plain.eval()
    mm = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "completion_mask")}
    with torch.no_grad():
        out = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True, **mm)
    ids, am, cm = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    img = torch.isin(ids, torch.tensor(image_token_ids(plain.config))) & am
    comp = cm.cumsum(1).bool() & am
    groups = torch.stack([img, am & ~comp & ~img, comp & ~img, torch.zeros_like(img)], dim=-1)
    ref = eager_group_masses(out.attentions, groups, cm)
    got = torch.stack([res.image, res.prompt_text, res.completion, res.special], dim=-1).double()
    record = {
        "rank": rank,
        "world_size": accelerator.num_processes,
        "max_abs_err": float((got - ref).abs().max()),
        "local_param_fraction": local_fraction,
        "n_image": res.n_image.tolist(),
        "rows": len(res.n_queries),
    }
    with open(out_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the group: a rank exiting with it alive can abort in gloo's teardown


if __name__ == "__main__":
    main()
