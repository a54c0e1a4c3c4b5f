"""perception_signal="attention": TPRL ranks tokens by the probe's per-token image mass, at no extra forward."""

import logging
import math

import pytest
import torch
from test_trainer import ForwardCounter, make_args, spread_reward

from trl_mdi import measure_modality_attention
from trl_mdi.attention.metrics import layer_segments
from trl_mdi.tprl import average_ranks, rank_correlation
from trl_mdi.trainer import MDIGRPOTrainer

PERCEPTION = dict(enable_perception_filtering=True, top_p_perception_tokens=0.25)


@pytest.fixture(scope="module")
def model_dir(tiny_vlm_dir):
    return tiny_vlm_dir("qwen2_5_vl")


# ------------------------------------------------------------------------------------------- pure functions
def _brute_spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho from its definition: Pearson correlation of average ranks (ties share their mean rank)."""
    def ranks(v):
        return [sum(x < y for x in v) + (sum(x == y for x in v) + 1) / 2 for y in v]

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def test_rank_correlation_matches_the_definition_with_ties_and_padding():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 4, (6, 9), generator=g).float()  # many ties
    b = a + torch.randn(6, 9, generator=g)
    mask = torch.ones(6, 9, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, :] = False
    mask[3, 1:] = False  # one token: undefined
    b[1, 5:] = float("nan")  # padding may hold anything
    rho = rank_correlation(a, b, mask)
    for i in range(6):
        m = mask[i]
        if m.sum() < 2:
            assert math.isnan(rho[i])
        else:
            assert rho[i].item() == pytest.approx(_brute_spearman(a[i][m].tolist(), b[i][m].tolist()), abs=1e-12)
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 3.0])).tolist() == [3.0, 1.0, 3.0, 3.0]


def test_config_rejects_an_unknown_signal(tmp_path):
    with pytest.raises(ValueError, match="perception_signal must be one of"):
        make_args(tmp_path, perception_signal="saliency")


# ------------------------------------------------------------------------------------------- in the trainer
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(perception_signal="attention"), 1),  # only the probe's forward
        (dict(perception_signal="attention", num_iterations=2), 1),  # TRL's old-logp forward, nothing of ours
        (dict(perception_signal="attention", enable_trajectory_reweighting=True), 1),
        (dict(perception_signal="perturbation"), 2),  # today's: probe forward + perturbed-image forward
    ],
    ids=["attention", "attention_rides_trl", "attention_with_tas", "perturbation"],
)
def test_attention_signal_adds_no_forward(model_dir, grpo_train_dataset, tmp_path, monkeypatch, overrides, expected):
    counter = ForwardCounter(monkeypatch)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, **PERCEPTION, **overrides), train_dataset=grpo_train_dataset)
    trainer.train()
    assert counter.per_generation and set(counter.per_generation) == {expected}, counter.per_generation
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["tprl/perception_token_fraction"] == pytest.approx(0.25)  # ceil(0.25 * 8) of 8 tokens


def _reference(model, input_ids, attention_mask, completion_length, mm):
    completion_mask = torch.zeros_like(attention_mask)
    completion_mask[:, -completion_length:] = attention_mask[:, -completion_length:]
    mm = {k: mm[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if mm.get(k) is not None}
    ref = measure_modality_attention(model, input_ids, attention_mask, completion_mask, token_segment="late", **mm)
    return ref.attention_signal(completion_length) * completion_mask[:, -completion_length:]


@pytest.mark.parametrize("rides_trl", [False, True], ids=["own_forward", "trl_forward"])
def test_the_signal_tprl_ranks_by_is_the_probes_exact_per_token_mass(model_dir, grpo_train_dataset, tmp_path,
                                                                     monkeypatch, rides_trl):
    """a_t, as the forward that measured it hands it on, equals measure_modality_attention on the same tokens (itself
    exact against eager attention, tests/test_families.py), aligned so that token t gets the mass of the position
    that chose it; whichever forward measured it (the trainer's own, or TRL's old-log-prob forward)."""
    checked = []
    if rides_trl:
        from trl import GRPOTrainer

        from trl_mdi.signals import PolicyForward

        original, original_measured, last = GRPOTrainer._get_per_token_logps_and_entropies, PolicyForward.measured, {}

        def forward_spy(trainer, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            if not torch.is_grad_enabled():  # TRL's old-log-prob forward, which the probe rides on
                last.update(model=trainer.model, input_ids=input_ids, attention_mask=attention_mask,
                            c_len=logits_to_keep, mm=kwargs)
            return original(trainer, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

        def measured_spy(cls, attention, completion_length, *args, **kwargs):
            forward = original_measured(attention, completion_length, *args, **kwargs)
            got = forward.perception["attention"] * last["attention_mask"][:, -last["c_len"]:]
            checked.append((got, _reference(last["model"], last["input_ids"], last["attention_mask"], last["c_len"],
                                            last["mm"])))
            return forward

        monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", forward_spy)
        monkeypatch.setattr(PolicyForward, "measured", classmethod(measured_spy))
    else:
        original = MDIGRPOTrainer._extra_forward

        def spy(trainer, map_rows, batch):
            forward = original(trainer, map_rows, batch)
            c_len = batch.logits_to_keep
            got = forward.perception["attention"] * batch.attention_mask[:, -c_len:]
            checked.append((got, _reference(trainer.model, batch.input_ids, batch.attention_mask, c_len,
                                            batch.multimodal)))
            return forward

        monkeypatch.setattr(MDIGRPOTrainer, "_extra_forward", spy)
    extra = dict(num_iterations=2) if rides_trl else {}
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, perception_signal="attention", **PERCEPTION, **extra),
                             train_dataset=grpo_train_dataset)
    n_layers = trainer.model.config.get_text_config().num_hidden_layers
    assert trainer.run_plan.token_layers == tuple(layer_segments(n_layers, "thirds")["late"])
    trainer.train()
    assert len(checked) == (1 if rides_trl else 2)  # num_iterations=2 reuses one generation for both steps
    for got, expected in checked:
        assert (got > 0).any()
        torch.testing.assert_close(got, expected.to(got.dtype), atol=1e-5, rtol=0)


def test_compare_logs_the_rank_correlation_and_the_rollout_log_marks_kept_tokens(model_dir, grpo_train_dataset,
                                                                                 tmp_path, monkeypatch):
    import trl_mdi.trainer as trainer_module

    counter = ForwardCounter(monkeypatch)
    compared = []  # per batch: the two per-token signals, the completion mask and has_image the trainer compared
    original = trainer_module.signal_rank_corr

    def spy(perturbation, attention, completion_mask, has_image, gather):
        compared.append([t.detach().cpu().clone() for t in (perturbation, attention, completion_mask, has_image)])
        return original(perturbation, attention, completion_mask, has_image, gather)

    monkeypatch.setattr(trainer_module, "signal_rank_corr", spy)
    args = make_args(tmp_path, perception_signal="attention", perception_signal_compare=True, **PERCEPTION)
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward], args=args, train_dataset=grpo_train_dataset)
    trainer.train()
    assert set(counter.per_generation) == {2}  # comparing costs the perturbed forward, and only that
    corr = [h["tprl/signal_rank_corr"] for h in trainer.state.log_history if "tprl/signal_rank_corr" in h]
    assert len(corr) == len(compared) == args.max_steps
    # Each logged value: Spearman's rho by its definition over each row's completion tokens (a signal shorter than
    # the mask counts as 0 beyond its end, as the trainer right-pads it), averaged over the rows with an image
    for logged, (perturbation, attention, mask, has_image) in zip(corr, compared):
        rhos = []
        for i in range(mask.shape[0]):
            tokens = [t for t in range(mask.shape[1]) if mask[i, t]]
            a = [float(perturbation[i, t]) if t < perturbation.shape[1] else 0.0 for t in tokens]
            b = [float(attention[i, t]) if t < attention.shape[1] else 0.0 for t in tokens]
            if has_image[i] and len(tokens) >= 2 and len(set(a)) > 1 and len(set(b)) > 1:
                rhos.append(_brute_spearman(a, b))
        assert rhos and logged == pytest.approx(sum(rhos) / len(rhos), abs=1e-6), (logged, rhos)
    log = (tmp_path / "logs" / "rollouts.md").read_text()
    assert log.count("**Perception (attention)**") == 2 * args.max_steps  # the two fully printed rollouts per step
    assert "of 8" in log and "⟦" in log and "Highest: `" in log


def test_compare_without_tprl_only_measures(model_dir, grpo_train_dataset, tmp_path):
    trainer = MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                             args=make_args(tmp_path, perception_signal_compare=True, max_steps=1),
                             train_dataset=grpo_train_dataset)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert "tprl/signal_rank_corr" in logs and "tprl/perception_token_fraction" not in logs


def test_missing_segment_falls_back_to_all_and_says_so(tiny_vlm_dir, grpo_train_dataset, tmp_path, caplog):
    path = tiny_vlm_dir("qwen2_5_vl", num_layers=1)  # thirds of one layer: only "middle"
    with caplog.at_level(logging.WARNING, logger="trl_mdi"):
        trainer = MDIGRPOTrainer(str(path), reward_funcs=[spread_reward],
                                 args=make_args(tmp_path, perception_signal="attention", **PERCEPTION),
                                 train_dataset=grpo_train_dataset)
    assert trainer.run_plan.token_layers == (0,)
    assert "does not have" in caplog.text and "all measured layers" in caplog.text


def test_attention_signal_needs_the_probe(model_dir, grpo_train_dataset, tmp_path):
    with pytest.raises(ValueError, match="compute_attention_metrics=False turns it off"):
        MDIGRPOTrainer(str(model_dir), reward_funcs=[spread_reward],
                       args=make_args(tmp_path, perception_signal="attention", compute_attention_metrics=False,
                                      **PERCEPTION), train_dataset=grpo_train_dataset)
