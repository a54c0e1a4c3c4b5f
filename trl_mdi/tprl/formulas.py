"""TPRL as pure tensor functions: VPPO's Token Gradient Filtering (TGF) and Trajectory Advantage Shaping (TAS).

Source: Huang et al., "Spotlight on Token Perception for Multimodal Reinforcement Learning"
(arXiv 2510.09285, code github.com/huaixuheqing/VPPO-RL). Option names follow the MTRL fork
(enable_perception_filtering / top_p_perception_tokens, enable_entropy_filtering / top_p_entropy_tokens,
enable_trajectory_reweighting / trajectory_scaling_min); VPPO calls the last one advantage_scaling_min.

Every tensor is (B, C) over completion tokens, B rollouts by C completion positions, with a
``completion_mask`` (B, C) of 0/1 (bool, int or float) marking the valid tokens; L_i = completion_mask[i].sum().

    d_t   = clamp(aug_logp_t - logp_t, -20, 20)                       logp under image I, aug_logp under I'
    s_t   = clamp(exp(d_t) - d_t - 1, 0, 10)                          token visual dependency (k3 of KL)
    TGF   : per sequence keep the top k_i = ceil(p * L_i) tokens by s_t (perception) or entropy (entropy);
            both on -> OR. The 0/1 mask multiplies the per-token loss; the loss normaliser is unchanged.
    a_t   = mean_{heads, layers of a segment} attention mass on image keys of the position choosing token t
                                                                      (perception_signal="attention": s_t := a_t)
    rho_i = Spearman(s_t, a_t) over the valid tokens of row i         how well attention tracks perturbation
    S_i   = mean_{t valid} s_t                                        trajectory visual dependency
    n_i   = (S_i - min S) / (max S - min S)                           min-max over the batch
    mu    = mean(n);  beta_max = beta_min + (1 - beta_min) / mu
    alpha_i = beta_min + n_i * (beta_max - beta_min)                  so mean(alpha) = 1;  A_i <- alpha_i * A_i

Nothing here reads a model, a config or a process group: the trainer gathers what it needs and wires it in.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# VPPO's clamps: the log-ratio is bounded so exp() cannot overflow, the score so one token cannot dominate.
LOG_RATIO_CLAMP = 20.0
SCORE_CLAMP = 10.0
# VPPO's threshold below which a batch's score spread counts as zero (scores live in [0, 10]).
DEGENERATE_SPREAD = 1e-6
# The per-token perception signal TGF and TAS can rank by, by kind: VPPO's perturbed-image score, or the probe's image mass.
PERCEPTION_SIGNALS = ("perturbation", "attention")


def fit_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad with zeros or cut (B, C) to (B, width): TRL may pad completions to a multiple of N, and a forward
    may keep fewer positions. Every per-token tensor of the project (TPRL's, the signals', the logs') is brought to
    the completion mask's width with it.

    >>> fit_width(torch.ones(1, 2), 3).tolist(), fit_width(torch.ones(1, 2), 1).tolist()
    ([[1.0, 1.0, 0.0]], [[1.0]])
    """
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))



def validate_top_p(value: float, name: str = "top_p") -> float:
    """Return ``value`` as a float if it lies in (0, 1]; else raise ValueError naming ``name``.

    >>> validate_top_p(0.2, "top_p_perception_tokens")
    0.2
    >>> validate_top_p(0.0, "top_p_entropy_tokens")
    Traceback (most recent call last):
    ...
    ValueError: top_p_entropy_tokens must be in (0, 1], got 0.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def validate_scaling_min(value: float, name: str = "trajectory_scaling_min") -> float:
    """Return ``value`` as a float if it lies in [0, 1]; else raise ValueError naming ``name``.

    >>> validate_scaling_min(0.8)
    0.8
    >>> validate_scaling_min(1.5)
    Traceback (most recent call last):
    ...
    ValueError: trajectory_scaling_min must be in [0, 1], got 1.5
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def _check_same_2d(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must both be (B, C) with the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 at least (bf16 log-probs are too coarse for exp(d) - d - 1 near d = 0), float64 kept."""
    return torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32


def perturbation_signal(logp: torch.Tensor, aug_logp: torch.Tensor) -> torch.Tensor:
    """The perturbation perception signal (VPPO's token visual dependency), per token:
    ``s_t = clamp(exp(d) - d - 1, 0, 10)``, ``d = clamp(aug_logp - logp, -20, 20)``.

    ``logp`` is the log-probability of each sampled completion token given the real image I (VPPO uses the
    rollout policy's ``old_log_probs``), ``aug_logp`` that of the SAME token given the perturbed image I'.
    ``s_t`` is the one-sample k3 estimator of KL(pi(.|I) || pi(.|I')) evaluated at the sampled token:
    0 when the perturbation leaves the token's probability unchanged, larger the more the token relies on
    the image. It is >= 0 and, thanks to the clamps, at most 10. Any shape works; the result has the
    shape of the broadcast inputs and dtype at least float32.

    Masking: the function is elementwise and knows nothing about padding. Values at padded positions
    are whatever the padded log-probs make them (0 when both are 0), so callers multiply by
    ``completion_mask`` (or pass the mask to ``top_p_token_mask`` / ``sequence_mean``, which ignore
    padded positions). NaN inputs give NaN. The function does not detach: pass log-probs computed
    without grad, since the scores are used as ranks and weights, not differentiated.

    >>> perturbation_signal(torch.tensor([-1.0, -1.0, -2.0]), torch.tensor([-1.0, -2.0, -1.0]))
    tensor([0.0000, 0.3679, 0.7183])
    >>> perturbation_signal(torch.tensor([-30.0]), torch.tensor([0.0]))  # clamped at 10
    tensor([10.])
    """
    dtype = torch.promote_types(_compute_dtype(logp), _compute_dtype(aug_logp))
    d = (aug_logp.to(dtype) - logp.to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(0.0, SCORE_CLAMP)


def sequence_mean(values: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean over valid tokens: ``S_i = sum_t m_it * v_it / L_i``, and 0 when ``L_i = 0``.

    Padded positions are excluded even when they hold NaN or inf. Used for TAS's trajectory score
    ``S_i = mean_t s_t``. Returns (B,) with dtype at least float32.

    >>> v = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0], [5.0, 5.0, 5.0]])
    >>> m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    >>> sequence_mean(v, m)
    tensor([1.5000, 4.0000, 0.0000])
    """
    _check_same_2d(values, completion_mask, "values", "completion_mask")
    valid = completion_mask != 0
    dtype = _compute_dtype(values)
    total = torch.where(valid, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device)).sum(
        dim=1
    )
    return total / valid.sum(dim=1).clamp(min=1).to(dtype)


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-D ranks 1..n of ``values``, ties sharing the mean of the ranks they span (Spearman's convention).

    >>> average_ranks(torch.tensor([0.5, 0.1, 0.5, 0.9]))
    tensor([2.5000, 1.0000, 2.5000, 4.0000], dtype=torch.float64)
    """
    order = torch.argsort(values, stable=True)
    _, inverse, counts = torch.unique_consecutive(values[order], return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # 0-based position where each run of equal values starts
    mean_rank = first.double() + (counts.double() + 1.0) / 2.0
    ranks = torch.empty(len(values), dtype=torch.float64, device=values.device)
    ranks[order] = mean_rank[inverse]
    return ranks


def rank_correlation(a: torch.Tensor, b: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Per row, Spearman's rho between ``a`` and ``b`` over the valid tokens: the Pearson correlation of their
    average ranks, ``rho_i = cov(R(a_i), R(b_i)) / (sd(R(a_i)) sd(R(b_i)))``. (B,) float64; NaN for a row with
    fewer than 2 valid tokens or whose ranks are constant in either signal (rho is undefined there).

    >>> m = torch.ones(3, 4)
    >>> a = torch.tensor([[1.0, 2, 3, 4], [1, 2, 3, 4], [1, 1, 1, 1]])
    >>> rank_correlation(a, torch.tensor([[10.0, 20, 30, 40], [4, 3, 2, 1], [1, 2, 3, 4]]), m)
    tensor([ 1., -1., nan], dtype=torch.float64)
    """
    _check_same_2d(a, completion_mask, "a", "completion_mask")
    _check_same_2d(b, completion_mask, "b", "completion_mask")
    out = torch.full((a.shape[0],), float("nan"), dtype=torch.float64)
    for i, valid in enumerate(completion_mask != 0):
        if valid.sum() < 2:
            continue
        ra, rb = average_ranks(a[i][valid].double()), average_ranks(b[i][valid].double())
        ra, rb = ra - ra.mean(), rb - rb.mean()
        denom = (ra.square().sum() * rb.square().sum()).sqrt()
        if denom > 0:
            out[i] = float((ra * rb).sum() / denom)
    return out


def top_p_token_mask(scores: torch.Tensor, completion_mask: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per sequence, select the ``k_i = ceil(top_p * L_i)`` valid tokens with the highest scores.

    ``L_i = completion_mask[i].sum()``. This is VPPO's per-sequence TGF rule (used with ``s_t`` for
    perception filtering and with token entropy for entropy filtering); it differs from TRL's
    ``top_entropy_quantile``, which thresholds over the whole batch.

    Ranking rule, fully deterministic (VPPO's unstable ``torch.sort`` leaves ties to the kernel):
      1. valid tokens with a non-NaN score (``+inf`` ranks first, ``-inf`` last among them),
      2. then valid tokens whose score is NaN (treated as lowest),
      3. padded positions are never selected (k_i never exceeds the number of valid tokens);
      equal scores (and NaNs among themselves): the EARLIER position wins.
    A zero-length row selects nothing. ``ceil`` is taken with a 1e-12 relative tolerance so that floating
    error in ``top_p * L_i`` (e.g. 0.07 * 100 = 7.000000000000001) does not add a token. Every non-empty
    row keeps at least one token. ``top_p`` must be in (0, 1]; ``top_p = 1`` selects every valid token.

    Vectorised: two stable sorts (by score, then by tier), no loop over rows. Returns bool (B, C).

    >>> s = torch.tensor([[0.1, 0.9, 0.5, 0.9, 0.0], [3.0, float("nan"), 1.0, 7.0, 2.0]])
    >>> m = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    >>> top_p_token_mask(s, m, 0.5).int()  # k = ceil(0.5 * 4) = 2 and ceil(0.5 * 3) = 2; tie at 0.9 irrelevant
    tensor([[0, 1, 0, 1, 0],
            [1, 0, 1, 0, 0]], dtype=torch.int32)
    >>> top_p_token_mask(s, m, 0.2).int()  # k = 1 each: tie 0.9 vs 0.9 goes to the earlier position
    tensor([[0, 1, 0, 0, 0],
            [1, 0, 0, 0, 0]], dtype=torch.int32)
    """
    top_p = validate_top_p(top_p)
    _check_same_2d(scores, completion_mask, "scores", "completion_mask")
    valid = completion_mask != 0
    b, c = scores.shape
    if b == 0 or c == 0:
        return torch.zeros((b, c), dtype=torch.bool, device=scores.device)

    score = scores.detach().to(_compute_dtype(scores))
    is_nan = torch.isnan(score)
    # NaN would break the descending sort; its tier (below) already puts it after every real score.
    score = torch.where(is_nan, torch.full_like(score, -math.inf), score)
    tier = valid.to(torch.int8) * (2 - is_nan.to(torch.int8))  # 2 = valid number, 1 = valid NaN, 0 = padded
    # Lexicographic (tier desc, score desc, position asc) from two stable sorts: position order survives
    # the first sort among equal scores, and score order survives the second sort within a tier.
    _, by_score = torch.sort(score, dim=1, descending=True, stable=True)
    _, by_tier = torch.sort(tier.gather(1, by_score), dim=1, descending=True, stable=True)
    order = by_score.gather(1, by_tier)

    length = valid.sum(dim=1)
    target = length.to(torch.float64) * top_p
    k = torch.ceil(target - target * 1e-12).long()
    k = torch.minimum(torch.clamp(k, min=1), length)  # >= 1 for non-empty rows, 0 for empty ones
    rank = torch.arange(c, device=scores.device).expand(b, c)
    mask = torch.zeros((b, c), dtype=torch.bool, device=scores.device)
    mask.scatter_(1, order, rank < k.unsqueeze(1))
    return mask & valid


def combine_masks(
    entropy_mask: torch.Tensor | None, perception_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """TGF's combined token mask: ``entropy_mask OR perception_mask`` over the enabled filters.

    ``None`` means "that filter is disabled". One enabled -> its mask (as bool); both -> their OR;
    neither -> ``None`` (no filtering: the caller leaves the loss untouched).

    >>> e, p = torch.tensor([[1, 0, 0]]), torch.tensor([[0, 0, 1]])
    >>> combine_masks(e, p)
    tensor([[ True, False,  True]])
    >>> combine_masks(None, p)
    tensor([[False, False,  True]])
    >>> combine_masks(None, None) is None
    True
    """
    masks = [m for m in (entropy_mask, perception_mask) if m is not None]
    if not masks:
        return None
    if len(masks) == 2 and masks[0].shape != masks[1].shape:
        raise ValueError(
            f"entropy_mask and perception_mask must have the same shape, "
            f"got {tuple(masks[0].shape)} and {tuple(masks[1].shape)}"
        )
    out = masks[0] != 0
    for m in masks[1:]:
        out = out | (m != 0)
    return out


class TrajectoryScaling(NamedTuple):
    """Result of ``trajectory_scaling``; every field is a tensor on the scores' device.

    alpha      (B,) advantage multipliers; 1 for invalid rows and for degenerate batches
    valid      (B,) bool, the rows that were normalised (given ``valid`` AND a finite score)
    beta_max   0-d, the largest multiplier, ``beta_min + (1 - beta_min) / mu`` (1 when degenerate)
    mu         0-d, mean normalised score over valid rows (NaN when degenerate: undefined)
    degenerate 0-d bool, True when alpha was set to 1 because the batch carries no spread
    """

    alpha: torch.Tensor
    valid: torch.Tensor
    beta_max: torch.Tensor
    mu: torch.Tensor
    degenerate: torch.Tensor


def trajectory_scaling(
    seq_scores: torch.Tensor, scaling_min: float, valid: torch.Tensor | None = None
) -> TrajectoryScaling:
    """TAS advantage multipliers ``alpha_i`` from trajectory scores ``S_i`` (B,).

    Over the valid rows V (``valid`` if given, and always only rows whose score is finite):

        n_i      = (S_i - min_V S) / (max_V S - min_V S)              in [0, 1]
        mu       = mean_V n
        beta_max = beta_min + (1 - beta_min) / mu                      beta_min = scaling_min in [0, 1]
        alpha_i  = beta_min + n_i * (beta_max - beta_min)             so mean_V alpha = 1 exactly

    The least visually dependent trajectory gets ``beta_min``, the most dependent ``beta_max``; the advantage
    becomes ``alpha_i * A_i``. Rows outside V (e.g. zero-length completions, NaN scores) get ``alpha = 1``,
    so the mean over the whole batch is 1 as well.

    Degenerate batches give ``alpha = 1`` everywhere and ``degenerate = True``: no valid row, one valid row,
    all valid scores equal (spread <= 1e-6, VPPO's threshold), or ``mu = 0``.

    No cap on beta_max (kept from VPPO): when most trajectories sit at the bottom of the range, mu is small
    and beta_max large. Since the top row has n = 1, mu >= 1/|V|; e.g. 100 rows, one outlier above 99 equal
    scores: mu = 0.01, and with beta_min = 0.8, beta_max = 0.8 + 0.2 * 100 = 20.8, a 20.8x advantage on the
    outlier (and 0.8x on the rest). ``beta_max`` is returned so the caller can log it (and ``alpha`` for
    min/max); any cap is the caller's explicit choice.

    Normalise over the whole gathered batch (all processes) and slice afterwards: VPPO normalises per
    device (its all-reduce is commented out), which makes alpha depend on how rows are sharded.

    >>> r = trajectory_scaling(torch.tensor([0.0, 1.0, 2.0, 5.0]), 0.8)
    >>> r.alpha, round(r.alpha.mean().item(), 6), round(r.beta_max.item(), 4)
    (tensor([0.8000, 0.9000, 1.0000, 1.3000]), 1.0, 1.3)
    >>> trajectory_scaling(torch.tensor([3.0, 3.0]), 0.8).alpha  # all equal: no shaping
    tensor([1., 1.])
    """
    beta_min = validate_scaling_min(scaling_min, "scaling_min")
    if seq_scores.dim() != 1:
        raise ValueError(f"seq_scores must be 1-D (B,), got shape {tuple(seq_scores.shape)}")
    dtype = _compute_dtype(seq_scores)
    scores = seq_scores.detach().to(dtype)
    device = scores.device
    ok = torch.isfinite(scores)
    if valid is not None:
        if valid.shape != scores.shape:
            raise ValueError(f"valid must have shape {tuple(scores.shape)}, got {tuple(valid.shape)}")
        ok = ok & (valid != 0)

    ones = torch.ones_like(scores)
    one = torch.ones((), dtype=dtype, device=device)
    nan = torch.full((), math.nan, dtype=dtype, device=device)
    degenerate = TrajectoryScaling(ones, ok, one, nan, torch.ones((), dtype=torch.bool, device=device))
    n_valid = int(ok.sum())
    if n_valid < 2:
        return degenerate
    s = scores[ok]
    lo, hi = s.min(), s.max()
    if not (hi - lo) > DEGENERATE_SPREAD:
        return degenerate
    n = ((s - lo) / (hi - lo)).clamp(0.0, 1.0)
    mu = n.mean()
    if not mu > 0:  # impossible once hi > lo (the max row has n = 1); kept as a guard
        return degenerate
    beta_max = beta_min + (1.0 - beta_min) / mu
    alpha = ones.clone()
    alpha[ok] = beta_min + n * (beta_max - beta_min)
    return TrajectoryScaling(alpha, ok, beta_max, mu, torch.zeros((), dtype=torch.bool, device=device))


# ---------------------------------------------------------------------------------------------------------------
# The placebo (an experiment control, ``tprl_placebo``): the same amount of filtering and reweighting, no link to
# the image. Issue 44: TPRL's push comes from visual dependency only if TPRL beats this.
# ---------------------------------------------------------------------------------------------------------------


def placebo_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator for the placebo at ``step`` of a run seeded ``seed``; ``stream`` separates independent draws
    (the token mask of each process, the multipliers' permutation). A pure function of its arguments:
    ``SeedSequence(seed, spawn_key=(step, stream))``, as the image perturbations draw theirs.

    >>> a, b = placebo_generator(0, 3), placebo_generator(0, 3)
    >>> torch.rand(2, generator=a).tolist() == torch.rand(2, generator=b).tolist()
    True
    """
    import numpy as np

    for name, v in (("seed", seed), ("step", step), ("stream", stream)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    state = np.random.SeedSequence(seed, spawn_key=(step, stream)).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def random_token_mask(completion_mask: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """The placebo of the perception filter: per sequence, ``k_i = ceil(top_p * L_i)`` valid tokens chosen uniformly
    at random (``top_p_token_mask`` over i.i.d. uniform scores drawn from ``generator``), so each row keeps exactly
    as many tokens as the real filter keeps, none chosen for depending on the image. Returns bool (B, C).

    >>> m = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    >>> random_token_mask(m, 0.4, placebo_generator(0, 0)).sum(1).tolist()  # ceil(0.4 * 5) = 2, ceil(0.4 * 2) = 1
    [2, 1]
    """
    scores = torch.rand(completion_mask.shape, generator=generator, dtype=torch.float64)
    return top_p_token_mask(scores.to(completion_mask.device), completion_mask, top_p)


def permute_valid(values: torch.Tensor, valid: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The placebo of trajectory reweighting: ``values`` (B,) with the entries at ``valid`` rows permuted among
    themselves at random (``generator``), the others unchanged. The multiset of multipliers, hence their mean (1)
    and spread, is TAS's own; which rollout gets which is chance.

    >>> v, ok = torch.tensor([0.8, 1.0, 1.2, 1.0]), torch.tensor([True, True, True, False])
    >>> out = permute_valid(v, ok, placebo_generator(1, 2))
    >>> sorted(out[:3].tolist()) == sorted(v[:3].tolist()), out[3].item()
    (True, 1.0)
    """
    if values.dim() != 1 or valid.shape != values.shape:
        raise ValueError(f"values and valid must be (B,) of one shape, got {tuple(values.shape)} and "
                         f"{tuple(valid.shape)}")
    index = torch.nonzero(valid.bool().cpu(), as_tuple=True)[0]
    out = values.clone()
    if len(index) > 1:
        order = index[torch.randperm(len(index), generator=generator)]
        out[index.to(values.device)] = values[order.to(values.device)]
    return out
