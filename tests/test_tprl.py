"""TPRL's pure functions (token visual dependency, TGF masks, TAS scaling) on hand-made tensors."""

import math

import pytest
import torch

from trl_mdi.tprl import formulas as T

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- token visual dependency


def test_visual_dependency_formula_and_clamps():
    logp = torch.tensor([-1.0, -1.0, -2.0, -60.0, 0.0, -0.5])
    aug = torch.tensor([-1.0, -2.0, -1.0, 0.0, -60.0, -0.5])
    s = T.perturbation_signal(logp, aug)
    d = torch.tensor([0.0, -1.0, 1.0])
    torch.testing.assert_close(s[:3], d.exp() - d - 1)
    assert s[0].item() == 0.0 and s[5].item() == 0.0  # unchanged probability: no dependency
    # d = +60 -> clamped to 20 -> exp(20) - 21 -> clamped to 10; d = -60 -> e^-20 + 19 -> clamped to 10.
    assert s[3].item() == 10.0 and s[4].item() == 10.0
    assert torch.isfinite(s).all() and (s >= 0).all()


def test_visual_dependency_is_unbiased_k3_estimate_of_kl():
    # Sampling x ~ p, E_p[s(x)] = sum_x p(x) (q/p - log(q/p) - 1) = KL(p || q) when no clamp is active.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, 0)
    q = torch.softmax(logits + torch.randn(50, generator=g, dtype=torch.float64), 0)  # I' shifts the logits
    s = T.perturbation_signal(p.log(), q.log())
    assert s.max() < 10  # clamps inactive, so the identity is exact
    torch.testing.assert_close((p * s).sum(), (p * (p / q).log()).sum())


def test_visual_dependency_promotes_low_precision_and_propagates_nan():
    s = T.perturbation_signal(
        torch.tensor([-1.0], dtype=torch.bfloat16), torch.tensor([-1.5], dtype=torch.bfloat16)
    )
    assert s.dtype == torch.float32
    assert (
        T.perturbation_signal(torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-1.0])).dtype
        == torch.float64
    )
    assert math.isnan(T.perturbation_signal(torch.tensor([NAN]), torch.tensor([0.0])).item())


# ---------------------------------------------------------------- sequence mean


def test_sequence_mean_ignores_padding_even_nan_and_zero_length_is_zero():
    v = torch.tensor([[2.0, 4.0, NAN, INF], [1.0, 0.0, 5.0, 0.0], [NAN, NAN, NAN, NAN]])
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(T.sequence_mean(v, m), torch.tensor([3.0, 3.0, 0.0]))
    torch.testing.assert_close(T.sequence_mean(v, m.bool()), T.sequence_mean(v, m.float()))
    with pytest.raises(ValueError, match="same shape"):
        T.sequence_mean(v, m[:, :3])


# ---------------------------------------------------------------- top-p token mask


def _reference_top_p(scores, mask, top_p):
    """Loop reference: rank valid tokens by (NaN last, score desc, position asc), keep ceil(p L)."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    for i in range(scores.shape[0]):
        row = scores[i].tolist()
        idx = [t for t in range(len(row)) if mask[i, t]]
        k = math.ceil(round(top_p * len(idx), 9))
        ranked = sorted(
            idx, key=lambda t, row=row: (math.isnan(row[t]), 0 if math.isnan(row[t]) else -row[t], t)
        )
        for t in ranked[:k]:
            out[i, t] = True
    return out


@pytest.mark.parametrize("top_p", [0.1, 0.2, 0.4, 0.5, 0.75, 1.0])
def test_top_p_matches_loop_reference_on_random_batches_with_ties_nan_and_holes(top_p):
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        scores = torch.randint(0, 4, (16, 23), generator=g).float()  # few distinct values: many ties
        scores[torch.rand(16, 23, generator=g) < 0.1] = NAN
        scores[torch.rand(16, 23, generator=g) < 0.05] = -INF
        mask = (torch.rand(16, 23, generator=g) < 0.8).int()  # holes in the middle, not only right padding
        mask[0] = 0  # one zero-length row
        got = T.top_p_token_mask(scores, mask, top_p)
        assert got.dtype == torch.bool
        assert torch.equal(got, _reference_top_p(scores, mask, top_p))
        lengths = mask.sum(1)
        expect_k = torch.tensor([math.ceil(round(top_p * int(n), 9)) for n in lengths])
        assert torch.equal(got.sum(1), expect_k)


def test_top_p_ties_go_to_the_earlier_position():
    scores = torch.tensor([[1.0, 5.0, 5.0, 5.0, 0.0, 5.0]])
    mask = torch.ones_like(scores)
    assert T.top_p_token_mask(scores, mask, 0.3).int().tolist() == [[0, 1, 1, 0, 0, 0]]  # k = 2
    flat = torch.zeros(1, 6)
    assert T.top_p_token_mask(flat, mask, 0.5).int().tolist() == [[1, 1, 1, 0, 0, 0]]


def test_top_p_zero_length_rows_select_nothing_and_nonempty_rows_keep_at_least_one():
    scores = torch.rand(3, 5)
    mask = torch.tensor([[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    got = T.top_p_token_mask(scores, mask, 0.01)
    assert got.sum(1).tolist() == [0, 1, 1]
    assert T.top_p_token_mask(torch.empty(0, 4), torch.empty(0, 4), 0.5).shape == (0, 4)


def test_top_p_never_selects_padding_even_with_the_largest_scores():
    scores = torch.tensor([[INF, 9.0, 1.0, 2.0], [100.0, -INF, 50.0, NAN]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]])
    got = T.top_p_token_mask(scores, mask, 1.0)
    assert torch.equal(got, mask.bool())  # p = 1: exactly the valid tokens, however they score
    half = T.top_p_token_mask(scores, mask, 0.5)
    assert half.int().tolist() == [[0, 0, 0, 1], [0, 1, 0, 0]]  # valid -inf still beats valid NaN


def test_top_p_nan_scores_rank_lowest():
    scores = torch.tensor([[NAN, -3.0, NAN, -5.0, NAN]])
    mask = torch.ones_like(scores)
    assert T.top_p_token_mask(scores, mask, 0.4).int().tolist() == [[0, 1, 0, 1, 0]]
    assert T.top_p_token_mask(scores, mask, 0.6).int().tolist() == [[1, 1, 0, 1, 0]]  # then earliest NaN


def test_top_p_selects_the_highest_scores():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(8, 40, generator=g)
    mask = torch.ones(8, 40)
    got = T.top_p_token_mask(scores, mask, 0.2)
    assert got.sum(1).tolist() == [8] * 8
    for i in range(8):
        assert scores[i][got[i]].min() > scores[i][~got[i]].max()


def test_top_p_ceil_is_robust_to_float_error():
    assert 0.07 * 100 > 7  # the float product overshoots 7 ...
    got = T.top_p_token_mask(torch.rand(1, 100), torch.ones(1, 100), 0.07)
    assert got.sum().item() == 7  # ... but we keep ceil(7) = 7 tokens, not 8


def test_top_p_validation():
    s, m = torch.rand(2, 3), torch.ones(2, 3)
    for bad in (0.0, -0.1, 1.01, NAN, True):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            T.top_p_token_mask(s, m, bad)
    with pytest.raises(ValueError, match="top_p_perception_tokens must be in"):
        T.validate_top_p(2, "top_p_perception_tokens")
    with pytest.raises(ValueError, match="same shape"):
        T.top_p_token_mask(s, m[:1], 0.5)
    with pytest.raises(ValueError, match=r"\(B, C\)"):
        T.top_p_token_mask(s[0], m[0], 0.5)


# ---------------------------------------------------------------- combine masks


def test_combine_masks():
    e = torch.tensor([[1, 0, 0, 1]])
    p = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    assert T.combine_masks(e, p).tolist() == [[True, False, True, True]]
    assert T.combine_masks(e, None).tolist() == [[True, False, False, True]]
    assert T.combine_masks(None, p).dtype == torch.bool
    assert T.combine_masks(None, None) is None
    with pytest.raises(ValueError, match="same shape"):
        T.combine_masks(e, p[:, :3])


# ---------------------------------------------------------------- trajectory scaling


@pytest.mark.parametrize("beta_min", [0.0, 0.5, 0.8, 0.9, 1.0])
def test_trajectory_scaling_mean_is_one_and_range_is_beta_min_to_beta_max(beta_min):
    g = torch.Generator().manual_seed(3)
    for n in (2, 3, 8, 64):
        s = torch.rand(n, generator=g) * torch.rand((), generator=g) * 10
        r = T.trajectory_scaling(s, beta_min)
        assert not r.degenerate
        assert r.alpha.mean().item() == pytest.approx(1.0, abs=1e-5)
        assert r.alpha.min().item() == pytest.approx(beta_min, abs=1e-5)
        assert r.alpha.max().item() == pytest.approx(r.beta_max.item(), rel=1e-5)
        assert r.beta_max.item() == pytest.approx(beta_min + (1 - beta_min) / r.mu.item(), rel=1e-5)
        order = torch.argsort(s)
        assert (r.alpha[order].diff() >= -1e-6).all()  # monotone in the score


def test_trajectory_scaling_hand_computed():
    r = T.trajectory_scaling(torch.tensor([2.0, 4.0, 6.0]), 0.5)  # n = 0, .5, 1; mu = .5; beta_max = 1.5
    torch.testing.assert_close(r.alpha, torch.tensor([0.5, 1.0, 1.5]))
    assert r.mu.item() == pytest.approx(0.5) and r.beta_max.item() == pytest.approx(1.5)
    r0 = T.trajectory_scaling(torch.tensor([2.0, 4.0, 6.0]), 0.0)
    torch.testing.assert_close(r0.alpha, torch.tensor([0.0, 1.0, 2.0]))  # beta_min = 0: alpha = n / mu


@pytest.mark.parametrize(
    "scores",
    [[3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0], [7.0], [], [1.0, 1.0 + 1e-7]],
    ids=["all-equal", "all-zero-mu0", "one-row", "empty", "spread-below-1e-6"],
)
def test_trajectory_scaling_degenerate_batches_give_one(scores):
    r = T.trajectory_scaling(torch.tensor(scores), 0.8)
    assert torch.equal(r.alpha, torch.ones(len(scores)))
    assert bool(r.degenerate) and r.beta_max.item() == 1.0 and math.isnan(r.mu.item())


def test_trajectory_scaling_invalid_rows_get_one_and_do_not_move_the_others():
    s = torch.tensor([1.0, 100.0, 3.0, -50.0, 5.0])
    valid = torch.tensor([True, False, True, False, True])
    r = T.trajectory_scaling(s, 0.8, valid)
    sub = T.trajectory_scaling(s[valid], 0.8)
    assert r.alpha[~valid].tolist() == [1.0, 1.0]
    torch.testing.assert_close(r.alpha[valid], sub.alpha)
    assert r.alpha.mean().item() == pytest.approx(1.0)  # still 1 over the whole batch
    assert torch.equal(r.valid, valid)
    none_valid = T.trajectory_scaling(s, 0.8, torch.zeros(5, dtype=torch.bool))
    assert torch.equal(none_valid.alpha, torch.ones(5)) and bool(none_valid.degenerate)
    one_valid = T.trajectory_scaling(s, 0.8, torch.tensor([0, 0, 1, 0, 0]))
    assert torch.equal(one_valid.alpha, torch.ones(5))


def test_trajectory_scaling_non_finite_scores_are_invalid_not_poison():
    r = T.trajectory_scaling(torch.tensor([0.0, NAN, 1.0, INF]), 0.8)
    assert r.valid.tolist() == [True, False, True, False]
    torch.testing.assert_close(r.alpha, torch.tensor([0.8, 1.0, 1.2, 1.0]))


def test_trajectory_scaling_keeps_vppo_uncapped_beta_max():
    s = torch.zeros(100)
    s[7] = 1.0  # one outlier: mu = 1 / 100
    r = T.trajectory_scaling(s, 0.8)
    assert r.mu.item() == pytest.approx(0.01)
    assert r.beta_max.item() == pytest.approx(0.8 + 0.2 * 100)
    assert r.alpha[7].item() == pytest.approx(20.8) and r.alpha.mean().item() == pytest.approx(1.0)


def test_trajectory_scaling_validation():
    for bad in (-0.1, 1.1, NAN):
        with pytest.raises(ValueError, match=r"scaling_min must be in \[0, 1\]"):
            T.trajectory_scaling(torch.rand(4), bad)
    with pytest.raises(ValueError, match="trajectory_scaling_min must be in"):
        T.validate_scaling_min(-1)
    with pytest.raises(ValueError, match="1-D"):
        T.trajectory_scaling(torch.rand(2, 2), 0.8)
    with pytest.raises(ValueError, match="valid must have shape"):
        T.trajectory_scaling(torch.rand(4), 0.8, torch.ones(3))


# ---------------------------------------------------------------- the pieces together, and the loss property


def test_pipeline_ignores_garbage_at_padded_positions():
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(6, 10, generator=g) * 3
    aug = logp + torch.randn(6, 10, generator=g)
    mask = torch.ones(6, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[4] = 0
    s = T.perturbation_signal(logp, aug)
    dirty_logp, dirty_aug = logp.clone(), aug.clone()
    dirty_logp[mask == 0], dirty_aug[mask == 0] = NAN, 123.0
    s_dirty = T.perturbation_signal(dirty_logp, dirty_aug)
    assert torch.equal(T.top_p_token_mask(s, mask, 0.3), T.top_p_token_mask(s_dirty, mask, 0.3))
    seq, seq_dirty = T.sequence_mean(s, mask), T.sequence_mean(s_dirty, mask)
    assert torch.equal(seq, seq_dirty)
    r = T.trajectory_scaling(seq, 0.9, valid=mask.sum(1) > 0)
    assert r.alpha[4].item() == 1.0 and r.alpha.mean().item() == pytest.approx(1.0)


def _dapo_per_token_loss(logp, old_logp, advantages, eps_low=0.2, eps_high=0.28):
    ratio = torch.exp(logp - old_logp)
    a = advantages.unsqueeze(1)
    return -torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)


def test_token_mask_zeroes_masked_gradients_and_leaves_kept_ones_unchanged():
    """The trainer multiplies the TGF mask into the per-token loss and keeps the normaliser (DAPO: number of
    valid tokens). Then masked tokens get exactly zero gradient and kept tokens exactly the gradient
    they get without filtering."""
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(4, 12, generator=g) * 2
    logp = (old + 0.3 * torch.randn(4, 12, generator=g)).requires_grad_(True)
    adv = torch.randn(4, generator=g)
    completion_mask = torch.ones(4, 12)
    completion_mask[2, 8:] = 0
    scores = T.perturbation_signal(old, old + torch.randn(4, 12, generator=g))
    keep = T.combine_masks(
        T.top_p_token_mask(torch.rand(4, 12, generator=g), completion_mask, 0.2),
        T.top_p_token_mask(scores, completion_mask, 0.2),
    )
    assert 0 < keep.sum() < completion_mask.sum()
    num_items = completion_mask.sum()  # fixed normaliser

    def grad(token_mask):
        per_token = _dapo_per_token_loss(logp, old, adv)
        loss = (per_token * completion_mask * token_mask).sum() / num_items
        (out,) = torch.autograd.grad(loss, logp)
        return out

    g_full, g_kept = grad(torch.ones(4, 12)), grad(keep.float())
    assert torch.all(g_kept[~keep] == 0)
    assert torch.equal(g_kept[keep], g_full[keep])
    assert (g_full[keep] != 0).any()  # the comparison is not vacuous


def test_token_mask_on_a_model_equals_the_loss_over_kept_tokens_only():
    torch.manual_seed(6)
    model = torch.nn.Linear(8, 5)
    x = torch.randn(3, 7, 8)
    tokens = torch.randint(0, 5, (3, 7))
    completion_mask = torch.ones(3, 7)
    completion_mask[0, 5:] = 0
    keep = T.top_p_token_mask(torch.rand(3, 7), completion_mask, 0.4)
    num_items = completion_mask.sum()

    def param_grads(token_mask):
        model.zero_grad()
        logp = torch.log_softmax(model(x), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        (-(logp * completion_mask * token_mask).sum() / num_items).backward()
        return [p.grad.clone() for p in model.parameters()]

    masked = param_grads(keep.float())
    kept_only = param_grads(torch.zeros(3, 7).masked_fill(keep, 1.0))  # same thing, built independently
    model.zero_grad()
    logp = torch.log_softmax(model(x), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (-logp[keep].sum() / num_items).backward()
    for a, b, c in zip(masked, kept_only, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(a, b)
    full = param_grads(torch.ones(3, 7))
    assert any(not torch.allclose(a, f) for a, f in zip(masked, full))  # filtering did change the update


# ---------------------------------------------------------------------------------------------------------------
# The placebo (tprl_placebo, issue 44): as much filtering and reweighting, no link to the image
# ---------------------------------------------------------------------------------------------------------------


def _placebo_args(placebo: bool, entropy: bool = True, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(enable_entropy_filtering=entropy, top_p_entropy_tokens=0.25,
                           enable_perception_filtering=True, top_p_perception_tokens=0.25,
                           enable_trajectory_reweighting=True, trajectory_scaling_min=0.8, tprl_placebo=placebo,
                           seed=7, perturbation_seed=None, **kw)


def _batch(seed=0, b=8, c=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, c + 1, (b,), generator=g)
    mask = (torch.arange(c)[None] < lengths[:, None]).long()
    return mask, torch.rand(b, c, generator=g), torch.rand(b, c, generator=g) * 3


def _apply(args, step=5, seed=0):
    from trl_mdi.tprl import apply_tprl

    mask, entropies, s_t = _batch(seed)
    out = {"completion_mask": mask, "advantages": torch.ones(mask.shape[0])}
    apply_tprl(out, args, entropies=entropies, perception=s_t, has_image=torch.ones(mask.shape[0], dtype=torch.bool),
               gather=lambda t: t, process_index=0, step=step)
    return out, mask, entropies, s_t


def test_placebo_keeps_as_many_tokens_at_random_and_permutes_the_multipliers():
    real, mask, entropies, s_t = _apply(_placebo_args(False, entropy=False))
    fake, *_ = _apply(_placebo_args(True, entropy=False))
    kept_real, kept_fake = real["tool_mask"].bool(), fake["tool_mask"].bool()
    assert torch.equal(kept_real.sum(1), kept_fake.sum(1))  # the same count per row: ceil(0.25 * L_i)
    assert not torch.equal(kept_real, kept_fake)  # ... not the same tokens
    assert not (kept_fake & ~mask.bool()).any()  # never padding
    # advantages 1 everywhere, so they ARE the multipliers: the same multiset, another order
    assert sorted(fake["advantages"].tolist()) == pytest.approx(sorted(real["advantages"].tolist()))
    assert not torch.allclose(fake["advantages"], real["advantages"])
    assert real["advantages"].argmax() == T.sequence_mean(s_t, mask).argmax()  # the real ones follow S_i
    # drawn per (seed, step): the same again at the same step, other draws at another step or seed
    again, *_ = _apply(_placebo_args(True, entropy=False))
    assert torch.equal(again["tool_mask"], fake["tool_mask"]) and torch.equal(again["advantages"], fake["advantages"])
    other_step, *_ = _apply(_placebo_args(True, entropy=False), step=6)
    assert not torch.equal(other_step["tool_mask"], fake["tool_mask"])
    other_seed = _placebo_args(True, entropy=False)
    other_seed.seed = 8
    assert not torch.equal(_apply(other_seed)[0]["tool_mask"], fake["tool_mask"])


def test_placebo_keeps_the_entropy_filter():
    real, mask, entropies, _ = _apply(_placebo_args(False))
    fake, *_ = _apply(_placebo_args(True))
    entropy_mask = T.top_p_token_mask(entropies, mask, 0.25)
    assert (fake["tool_mask"].bool() >= entropy_mask).all()  # every token the entropy filter keeps is kept
    extra = fake["tool_mask"].bool() & ~entropy_mask
    assert (extra.sum(1) <= T.top_p_token_mask(torch.rand(mask.shape), mask, 0.25).sum(1)).all()


def test_placebo_pure_functions():
    m = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    for step in range(5):
        kept = T.random_token_mask(m, 0.5, T.placebo_generator(3, step))
        assert kept.sum(1).tolist() == [2, 1, 0] and not (kept & ~m.bool()).any()
    draws = {tuple(T.random_token_mask(torch.ones(1, 10), 0.3, T.placebo_generator(0, s)).nonzero()[:, 1].tolist())
             for s in range(20)}
    assert len(draws) > 10  # uniform over positions, not a fixed pick
    v, ok = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([True, False, True, True])
    out = T.permute_valid(v, ok, T.placebo_generator(0, 1))
    assert out[1] == 2.0 and sorted(out[[0, 2, 3]].tolist()) == [1.0, 3.0, 4.0]
    assert torch.equal(T.permute_valid(v, torch.tensor([True, False, False, False]), T.placebo_generator(0, 1)), v)
    with pytest.raises(ValueError, match="integer >= 0"):
        T.placebo_generator(-1, 0)
