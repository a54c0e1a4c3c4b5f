"""Run under ``python -m torch.distributed.run --nproc_per_node 2`` (CPU, gloo): the trainer's own forwards under
FSDP2 (torch's ``fully_shard``), against an unsharded copy of the same checkpoint.

The model is wrapped into ``fully_shard`` units as accelerate's FSDP2 plugin wraps it (``shard``;
``accelerate_configs/fsdp2.yaml``: transformer-based wrap of the decoder layer and vision block classes), on a
2-process CPU mesh. Each rank runs its own rows and checks, against the unsharded
model on the same rows:

1. a training step on a text-only batch with the dummy vision pass (``install_zero_weighted_vision_pass``): the loss
   equals the plain text-only run's, every gradient the plain runs' averaged over the ranks (as FSDP2 reduces them), the vision
   parameters' gradients are zero, the tower ran once;
2. then the counterfactual's choice-letter logits: the hidden state at the answer position (``hidden_states_at`` on
   a no-grad forward) through the LM head's rows (``choice_logits``, outside the forward): with accelerate's wrap the
   head is still unsharded there; with a tail that reshards after forward it is a sharded DTensor;
3. the attention probe (``measure_modality_attention``): masses, per-token image mass, per-image maps;
4. a forward of the model on the counterfactual's black image (what the reliance forward runs): log-probs equal.

Writes one JSON line per rank to argv[2]: the largest differences, and which parameters were DTensors.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fixtures/ and trl_mdi/
from fixtures.testing import grpo_batch, shape_image  # noqa: E402
from trl_mdi.attention import measure_modality_attention  # noqa: E402
from trl_mdi.attention.model_parts import choice_logits, hidden_states_at  # noqa: E402
from trl_mdi.vision_pass import dummy_vision_inputs, install_zero_weighted_vision_pass  # noqa: E402

MODEL_KEYS = ("input_ids", "attention_mask", "completion_mask")


def shard(model, mesh, tail_reshard: bool = False):
    """``fully_shard`` units as accelerate's FSDP2 plugin makes them (accelerate.utils.fsdp_utils.fsdp2_prepare_model,
    transformer-based wrap): each decoder layer and vision block, the input embedding when untied, the tail (final
    norm and LM head, with the tied embedding) without resharding after forward, and the root. ``tail_reshard``: the
    tail reshards after forward too (``fully_shard``'s default for a unit that is not the root: what a wrap of one's
    own gives), so the LM head is a sharded DTensor whenever no forward is running."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if type(module).__name__ in ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"):
            fully_shard(module, mesh=mesh)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed.weight is head.weight
    if not tied:
        fully_shard(embed, mesh=mesh)
    tail = [model.model.language_model.norm, *((embed, head) if tied else (head,))]
    fully_shard(tail, mesh=mesh, reshard_after_forward=tail_reshard)
    fully_shard(model, mesh=mesh)
    return model


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).nan_to_num(0.0).abs().max())


def completion_logps(model, batch) -> torch.Tensor:
    c = int(batch["completion_mask"].shape[1] - batch["completion_mask"].float().argmax(1).min())
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                       **{k: v for k, v in batch.items() if k not in MODEL_KEYS}).logits
    logp = torch.log_softmax(logits[:, -c - 1:-1].float(), -1)
    return logp.gather(-1, batch["input_ids"][:, -c:, None])[..., 0] * batch["completion_mask"][:, -c:]


def main():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model = shard(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(), mesh)
    processor = AutoProcessor.from_pretrained(path)
    head = model.get_output_embeddings().weight
    report = {"rank": rank, "head_is_dtensor": isinstance(head, DTensor),
              "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
              "params": sum(1 for _ in model.parameters())}

    # Each rank its own rows and lengths, as under data parallelism.
    batch = grpo_batch(processor, ["What colour is the shape? A. red B. blue", "Shape?" + " now" * rank],
                       [shape_image(56, rank), shape_image(56, 5)], [5 + rank, 3], seed=rank)
    mm = {k: v for k, v in batch.items() if k not in MODEL_KEYS}

    # 1. the dummy vision pass on a text-only batch, forward and backward
    text = grpo_batch(processor, ["No image here, just text."], [None], [4], seed=10 + rank)
    grads, losses, counts = {}, {}, {}
    for name, m in (("fsdp2", model), ("plain", plain)):
        state = install_zero_weighted_vision_pass(m, dummy_vision_inputs(processor)) if name == "fsdp2" else None
        m.train()
        m.zero_grad()
        loss = m(input_ids=text["input_ids"], attention_mask=text["attention_mask"], labels=text["input_ids"],
                 use_cache=False).loss
        loss.backward()
        losses[name] = float(loss)
        grads[name] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone())
                       for n, p in m.named_parameters() if p.grad is not None}
        if name == "plain":  # FSDP2 averages the ranks' gradients (reduce-scatter): so does the reference
            for g in grads[name].values():
                dist.all_reduce(g)
                g /= dist.get_world_size()
        counts[name] = state.count if state else 0
        if state:
            state.remove()
        m.eval()
    report["vision_pass_count"] = counts["fsdp2"]
    report["vision_pass_loss"] = abs(losses["fsdp2"] - losses["plain"])
    common = grads["plain"].keys() & grads["fsdp2"].keys()
    report["vision_pass_grad"] = max(max_diff(grads["fsdp2"][n], grads["plain"][n]) for n in common)
    visual = [n for n in grads["fsdp2"] if "visual" in n]
    report["vision_grads_present"] = len(visual)
    report["vision_grads_max"] = max(float(grads["fsdp2"][n].abs().max()) for n in visual) if visual else None
    report["text_grads_compared"] = len(common)

    # 2. the choice-letter logits: hidden state at a position, through the (sharded) LM head's rows
    c = int(batch["completion_mask"].sum(1).max())
    positions = torch.tensor([c - 1, 0])
    letters = processor.tokenizer.convert_tokens_to_ids(["ĠA", "ĠB", "ĠC"])
    candidates = torch.tensor([letters, letters[:2] + [-1]])
    logits = {}
    for name, m in (("fsdp2", model), ("plain", plain)):
        with torch.no_grad(), hidden_states_at(m.model, positions, c) as hidden:
            m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, **mm)
        if name == "fsdp2":  # what choice_logits finds: after a training step and this no-grad forward
            report["head_sharded_at_read"] = isinstance(m.get_output_embeddings().weight, DTensor)
        logits[name] = choice_logits(m, hidden.result(), candidates)
    # The same read with the head resharded after the forward (a second copy, wrapped with tail_reshard).
    resharded = shard(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(), mesh, True)
    with torch.no_grad(), hidden_states_at(resharded.model, positions, c) as hidden:
        resharded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False, **mm)
    report["head_sharded_at_read_resharded"] = isinstance(resharded.get_output_embeddings().weight, DTensor)
    try:
        got = choice_logits(resharded, hidden.result(), candidates)
        report["choice_logits_resharded"] = max_diff(got, logits["plain"])
        report["choice_logits_resharded_type"] = type(got).__name__
    except Exception as err:  # noqa: BLE001 - reported, so that the test names what failed
        report["choice_logits_resharded_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    report["choice_logits_type"] = type(logits["fsdp2"]).__name__  # a plain tensor, as the signals downstream expect
    report["choice_logits"] = max_diff(logits["fsdp2"].full_tensor() if isinstance(logits["fsdp2"], DTensor)
                                       else logits["fsdp2"], logits["plain"])
    report["choice_logits_finite"] = int(torch.isfinite(logits["fsdp2"]).sum())

    # 3. the probe
    got = measure_modality_attention(model, **batch, image_map_rows=[0], token_segment="late")
    want = measure_modality_attention(plain, **batch, image_map_rows=[0], token_segment="late")
    stack = lambda r: torch.stack([r.image, r.prompt_text, r.completion, r.special], -1)  # noqa: E731
    report["probe"] = max(max_diff(stack(got), stack(want)), max_diff(got.query_image_mass, want.query_image_mass),
                          max_diff(got.image_token_mass[0], want.image_token_mass[0]))
    report["probe_mean_image_mass"] = float(got.image.nanmean())

    # 4. the counterfactual's forward: the same rows with a black image of the same size
    black = grpo_batch(processor, ["What colour is the shape? A. red B. blue", "Shape?" + " now" * rank],
                       [Image.new("RGB", (56, 56)), Image.new("RGB", (56, 56))], [5 + rank, 3], seed=rank)
    report["counterfactual_logps"] = max_diff(completion_logps(model, black), completion_logps(plain, black))

    dist.barrier()
    with open(out_path, "a") as f:
        f.write(json.dumps(report) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
