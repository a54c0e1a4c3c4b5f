"""The zero-weighted dummy vision pass: image-less processes run the vision tower, outputs and gradients unchanged."""

import pytest
import torch
from test_trainer import make_args, spread_reward
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import GRPOConfig, GRPOTrainer

from fixtures.testing import family_params
from fixtures.tiny import TINY_ARCHS
from trl_mdi.trainer import MDIGRPOTrainer
from trl_mdi.vision_pass import dummy_vision_inputs, vision_pass_for_run, zero_weighted_vision_pass


@pytest.mark.parametrize("arch", family_params(TINY_ARCHS))
def test_every_family_runs_its_tower_and_keeps_loss_and_gradients(tiny_vlm_dir, arch):
    path = tiny_vlm_dir(arch)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    ids = processor.tokenizer(["a text-only row, no image at all"], return_tensors="pt")

    def step(dummy: bool):
        model.zero_grad()
        with (zero_weighted_vision_pass(model, dummy_vision_inputs(processor)) if dummy
              else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)) as state:
            loss = model(**ids).logits.float().square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, getattr(state, "count", 0)

    plain_loss, plain_grads, _ = step(False)
    loss, grads, count = step(True)
    assert count == 1 and torch.equal(loss, plain_loss)
    for name, g in grads.items():  # the tower now has gradients, all exactly zero; the rest bit-identical
        assert torch.equal(g, plain_grads[name]) if name in plain_grads else not g.any(), name
    assert len(grads) > len(plain_grads)  # DDP's unused-parameter check sees the tower used


def test_decode_steps_and_image_batches_run_no_dummy(tiny_vlm_dir):
    path = tiny_vlm_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    ids = processor.tokenizer(["no image"], return_tensors="pt")
    with zero_weighted_vision_pass(model, dummy_vision_inputs(processor)) as state, torch.no_grad():
        model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert state.count == 1  # the prefill only, never a cached decoding step


def test_a_text_only_batch_has_stock_grpo_loss_with_the_dummy_pass(tiny_vlm_dir, grpo_train_dataset, tmp_path):
    """The loss MDIGRPOTrainer computes on a text-only batch with the dummy pass installed equals stock
    GRPOTrainer's loss on the same batch (same weights, same tensors)."""
    path = tiny_vlm_dir("qwen2_5_vl")
    text_only = grpo_train_dataset.map(lambda ex: {"image": None})
    ours = MDIGRPOTrainer(str(path), reward_funcs=[spread_reward], args=make_args(tmp_path / "a", max_steps=1),
                          train_dataset=text_only)
    assert ours.vision_pass is None  # one process: not installed by default
    ours.vision_pass = vision_pass_for_run(ours.model, ours.processing_class, 2, True, print)
    ours.model.train()
    ours.current_gradient_accumulation_steps = 1  # set by Trainer's loop; compute_loss reads it
    batch = ours._generate_and_score_completions(next(iter(ours.get_train_dataloader())))
    batch.pop("trl_mdi_rollout", None)
    loss = ours.compute_loss(ours.model, dict(batch))
    assert ours.vision_pass.count >= 1
    stock = GRPOTrainer(str(path), reward_funcs=[spread_reward], train_dataset=text_only, args=GRPOConfig(
        output_dir=str(tmp_path / "b"), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=8, max_steps=1, seed=0, learning_rate=1e-3))
    stock.model.load_state_dict(ours.model.state_dict())
    stock.model.train()
    stock.current_gradient_accumulation_steps = 1
    assert torch.equal(stock.compute_loss(stock.model, dict(batch)), loss)


def test_without_a_dummy_pass_zero3_keeps_the_clear_error():
    """A model that cannot take the pass: a batch with images on some processes only stops every process clearly."""
    from types import SimpleNamespace

    from trl_mdi.vision_pass import images_on_some_processes_only

    image_row, text_row = {"images": ["an image"]}, {"images": []}
    peers = {"other_has_image": False}
    accelerator = SimpleNamespace(num_processes=2, device="cpu",
                                  gather=lambda t: torch.cat([t, torch.tensor([float(peers["other_has_image"])])]))
    with pytest.raises(RuntimeError, match="images on some processes and none on others"):
        images_on_some_processes_only([image_row], accelerator, has_vision_pass=False, zero3=True)
    assert images_on_some_processes_only([image_row], accelerator, has_vision_pass=True, zero3=True) is True
    assert images_on_some_processes_only([text_row], accelerator, has_vision_pass=False, zero3=False) is False
    peers["other_has_image"] = True
    assert images_on_some_processes_only([image_row], accelerator, has_vision_pass=False, zero3=True) is False


@pytest.mark.parametrize("arch", family_params(TINY_ARCHS))
def test_a_slice_with_zero_images_is_the_text_only_forward(tiny_vlm_dir, arch):
    """TRL hands a chunk / micro-batch of text-only rows image tensors sliced to zero images: with the guard the
    forward equals the text-only forward bit for bit (and, with the dummy pass, runs the dummy)."""
    from fixtures.testing import shape_image
    from trl_mdi.vision_pass import drop_empty_image_inputs

    path = tiny_vlm_dir(arch)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    ids = processor.tokenizer(["a text-only row, no image at all"], return_tensors="pt")
    image_inputs = processor(text=[processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}])],
        images=[[shape_image(56, 0)]], return_tensors="pt")
    empty = {k: v[:0] for k, v in image_inputs.items()
             if k in ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask")}
    assert "pixel_values" in empty and empty["pixel_values"].shape[0] == 0
    with torch.no_grad():
        plain = model(**ids).logits
        handle = drop_empty_image_inputs(model)
        guarded = model(**ids, **empty).logits
        with zero_weighted_vision_pass(model, dummy_vision_inputs(processor)) as state:
            with_dummy = model(**ids, **empty).logits
        handle.remove()
    assert torch.equal(guarded, plain) and torch.equal(with_dummy, plain) and state.count == 1
    if arch == "qwen2_5_vl":  # what users hit before: the model cannot take an empty image slice
        with pytest.raises(ValueError, match="non-empty list"), torch.no_grad():
            model(**ids, **empty)


def test_mixed_data_trains_when_a_micro_batch_holds_text_rows_only(tiny_vlm_dir, tmp_path, monkeypatch):
    """One process, image and text-only prompts alternating, one row per micro-batch and four per generation batch:
    TRL's chunked log-prob forward and two of every four micro-batches get zero-image slices, and the run trains."""
    from fixtures.testing import zen_image_dataset

    seen = []
    original = GRPOTrainer.compute_loss

    def compute_loss(trainer, model, inputs, *args, **kwargs):
        pixels = inputs.get("pixel_values")
        seen.append(pixels is not None and pixels.shape[0] > 0)
        return original(trainer, model, inputs, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "compute_loss", compute_loss)
    args = make_args(tmp_path, per_device_train_batch_size=1, num_generations=2, steps_per_generation=4,
                     gradient_accumulation_steps=4, shuffle_dataset=False, max_steps=2)
    trainer = MDIGRPOTrainer(str(tiny_vlm_dir("qwen2_5_vl")), reward_funcs=[spread_reward], args=args,
                             train_dataset=zen_image_dataset(8, images_per_row=[1, 0]))
    trainer.train()
    assert trainer.state.global_step == 2 and seen.count(False) == 4 and seen.count(True) == 4, seen
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


def test_the_dummy_pass_backward_meets_the_modules_an_image_batch_meets(tiny_vlm_dir):
    """ZeRO-3 records the order in which backward meets each module and stops when processes disagree. Ovis2's image
    processes call its visual embedding table twice (the image tokens' probabilities, the indicator tokens' rows) and
    both reach the loss; the dummy pass must use both outputs too (before, it summed pooler_output only: one call
    fewer in backward, and the every-family ZeRO-3 launch stopped with "disagreement on list length ... 225 / 224")."""
    from fixtures.testing import shape_image

    path = tiny_vlm_dir("ovis2")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    calls = []
    model.model.visual_embeddings_table.register_full_backward_pre_hook(lambda *_: calls.append(1))

    def backward_calls(inputs, dummy: bool):
        calls.clear()
        with (zero_weighted_vision_pass(model, dummy_vision_inputs(processor)) if dummy
              else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
            model(**inputs).logits.float().square().mean().backward()
        return len(calls)

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Shape?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    image_batch = processor(text=[text], images=[[shape_image(56, 1)]], return_tensors="pt")
    text_only = processor.tokenizer(["a text-only row, no image at all"], return_tensors="pt")
    assert backward_calls(image_batch, dummy=False) == backward_calls(text_only, dummy=True) == 2
