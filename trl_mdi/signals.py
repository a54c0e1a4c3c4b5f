"""Per-rollout signals: the one module that names and computes every value the trainer derives per rollout.

``SIGNALS`` is the table. Each entry says what a value is (its glossary line), how it is computed from the probe's
result, and where it goes: handed to reward functions as a named argument (``reward``), logged as
``attention/<name>`` (``metric``, the mean over the rollouts of the generation batch where it is finite), and shown
as a column of the attention log (``log``). A name holding ``{segment}`` stands for one value per layer segment
(``mdi_{segment}`` -> ``mdi_early``, ``mdi_middle``, ``mdi_late``). Everything else reads this table: the trainer
(reward fields, metrics), the live logs (columns), the reward registry (which inputs the trainer provides), the
reward-input check at construction, and the metric glossary in docs/ (tests/test_readme.py checks it).

Adding a signal is one entry here plus its test: see docs/signals.md for a worked example.

Values are computed over the *measured* layers (softmax attention; a hybrid model's linear layers are left out).
A rollout without image tokens has NaN MDI / AEI / balance, which reward functions receive as None. A segment whose
layers give the image exactly zero attention (a sliding window hiding every image key) has MDI = +inf: it leaves
the metric means and is counted in ``attention/rows_mdi_inf``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .attention import ModalityAttention
from .attention import metrics as M


@dataclass(frozen=True)
class SignalInputs:
    """What a signal is computed from: the probe's result, the metrics of one layer segment (all measured layers
    for a signal without ``{segment}``), and the balance ratio R."""

    attention: ModalityAttention
    segment: dict[str, torch.Tensor]  # M.segment_metrics of one segment: mdi, aei_text, aei_image, *_mass
    balance_ratio: float


@dataclass(frozen=True)
class Signal:
    name: str  # field name; "{segment}" expands to one value per layer segment
    help: str  # one line: the glossary, the registry help
    compute: Callable[[SignalInputs], torch.Tensor] | None  # (B,) values; None: computed over gathered groups
    reward: bool = False  # handed to reward functions as a named argument
    metric: bool = False  # logged as attention/<name>: mean over rollouts where finite
    log: str | None = None  # attention log column header ("{segment}" expands too)
    label: str | None = None  # its name in the attention log's step summary when it is no column (default: log)

    @property
    def per_segment(self) -> bool:
        return "{segment}" in self.name


def _layer_mean(x: SignalInputs, group: str) -> torch.Tensor:
    return getattr(x.attention, group)[:, x.attention.layers].mean(dim=1)


SIGNALS: tuple[Signal, ...] = (
    Signal("mdi", "MDI over all measured layers, (A_T / n_T) / (A_O / n_O): > 1 text dominates, < 1 the image does",
           lambda x: x.segment["mdi"], reward=True, metric=True, log="MDI all"),
    Signal("mdi_{segment}", "MDI of one layer segment (thirds of the measured layers by default: early, middle, late)",
           lambda x: x.segment["mdi"], reward=True, metric=True, log="MDI {segment}"),
    Signal("mdi_group_score", "rank of |log MDI| within the rollout's group, 1 (most balanced) to -1, zero-mean",
           None, reward=True),
    Signal("aei_text", "attention efficiency of text keys, P_T / Q_T (1 = attention proportional to token count)",
           lambda x: x.segment["aei_text"], reward=True, metric=True, log="AEI text"),
    Signal("aei_image", "attention efficiency of image keys, P_O / Q_O", lambda x: x.segment["aei_image"],
           reward=True, metric=True, log="AEI vision"),
    Signal("aei_text_{segment}", "AEI of text keys in one layer segment", lambda x: x.segment["aei_text"],
           reward=True, metric=True, label="AEI text {segment}"),
    Signal("aei_image_{segment}", "AEI of image keys in one layer segment", lambda x: x.segment["aei_image"],
           reward=True, metric=True, label="AEI vision {segment}"),
    Signal("mdi_balance", "the brief's balance, clip(1 - |log MDI| / log R, 0, 1): 1 at MDI = 1, 0 outside (1/R, R)",
           lambda x: M.mdi_balance(x.segment["mdi"], x.balance_ratio), reward=True, metric=True, log="balance"),
    Signal("image_mass", "attention mass of the generated tokens on image keys (mean over heads, tokens, layers)",
           lambda x: _layer_mean(x, "image"), metric=True),
    Signal("prompt_text_mass", "attention mass on prompt text keys", lambda x: _layer_mean(x, "prompt_text"),
           metric=True),
    Signal("completion_mass", "attention mass on the completion's own earlier tokens",
           lambda x: _layer_mean(x, "completion"), metric=True),
    Signal("special_mass", "attention mass on special tokens and the system turn (attention_text_keys='content')",
           lambda x: _layer_mean(x, "special"), metric=True),
    Signal("n_image", "image keys", lambda x: x.attention.n_image.float(), log="n image"),
    Signal("n_prompt_text", "prompt text keys", lambda x: x.attention.n_prompt_text.float(), log="n text"),
    Signal("n_special", "special keys", lambda x: x.attention.n_special.float(), log="n special"),
    Signal("n_completion", "completion keys", lambda x: x.attention.n_completion.float(), log="n completion"),
    Signal("n_queries", "measured (generated) tokens", lambda x: x.attention.n_queries.float(), log="n queries"),
    Signal("image_blind_layers", "measured layers in which the image gets exactly zero attention (sliding windows)",
           lambda x: x.attention.image_blind_layers().float(), metric=True, log="blind layers"),
)

# Batch-level counts logged beside the means, computed from the gathered table.
BATCH_METRICS: dict[str, str] = {
    "attention/rows_without_image": "fraction of rollouts without image tokens (no MDI)",
    "attention/rows_unmeasured": "fraction of rollouts with no generated token to measure (empty completion)",
    "attention/rows_mdi_inf": "fraction of rollouts in which some segment (or all layers) gives the image exactly zero "
                              "attention: that MDI is +inf and leaves its segment's mean (e.g. a sliding window that "
                              "hides every image key)",
}


# ------------------------------------------------------------------------------------------------ names
def expand(signal: Signal, segments: Sequence[str]) -> list[str]:
    """The field names of one signal for the given segment names (``"all"`` excluded from per-segment names)."""
    if not signal.per_segment:
        return [signal.name]
    return [signal.name.format(segment=s) for s in segments if s != "all"]


def field_names(segments: Sequence[str], *, reward: bool | None = None) -> list[str]:
    """Every per-rollout field for these segments (``reward=True``: those handed to reward functions).

    >>> field_names(["late"], reward=True)
    ['mdi', 'mdi_late', 'mdi_group_score', 'aei_text', 'aei_image', 'aei_text_late', 'aei_image_late', 'mdi_balance']
    """
    return [n for s in SIGNALS if reward is None or s.reward == reward for n in expand(s, segments)]


def signal_of(name: str) -> Signal | None:
    """The table entry a field name belongs to: an exact fixed name first (``mdi_balance`` is its own signal, not
    MDI of a segment called "balance"), then a per-segment template.

    >>> signal_of("mdi_late").name, signal_of("mdi_balance").name, signal_of("label_idx")
    ('mdi_{segment}', 'mdi_balance', None)
    """
    for s in SIGNALS:
        if not s.per_segment and s.name == name:
            return s
    for s in SIGNALS:
        if s.per_segment and re.fullmatch(re.escape(s.name).replace(r"\{segment\}", r"[A-Za-z_]\w*"), name):
            return s
    return None


RELIANCE_SIGNALS = ("visual_gain", "answer_visual_gain", "blind_agrees", "answer_image_attention")
"""The per-rollout counterfactual reliance signals (``trl_mdi.counterfactual``), in the order the logs show them."""

RELIANCE_FIELDS = (*RELIANCE_SIGNALS, "answer_visual_gain_group_score")
"""The reliance fields the trainer adds to the rows TRL hands to reward functions (None where undefined)."""


def trainer_field(name: str) -> bool:
    """Whether a reward input named ``name`` is a per-rollout field the trainer computes (attention or reliance),
    not a dataset column.

    >>> trainer_field("mdi_late"), trainer_field("blind_agrees"), trainer_field("label_idx")
    (True, True, False)
    """
    return reward_field_pattern(name) or name in RELIANCE_FIELDS


def reward_field_pattern(name: str) -> bool:
    """Whether a reward input named ``name`` is (for some segment names) a signal the trainer provides.

    >>> reward_field_pattern("mdi_late"), reward_field_pattern("aei_text"), reward_field_pattern("label_idx")
    (True, True, False)
    """
    signal = signal_of(name)
    return signal is not None and signal.reward


def reserved_segment_names() -> set[str]:
    """Segment names whose per-segment fields would overwrite another signal (e.g. ``balance``: ``mdi_balance``)."""
    fixed = {s.name for s in SIGNALS if not s.per_segment}
    reserved = {"all"}
    for s in SIGNALS:
        if s.per_segment:
            prefix, _, suffix = s.name.partition("{segment}")
            reserved |= {f[len(prefix): len(f) - len(suffix)] for f in fixed
                         if f.startswith(prefix) and f.endswith(suffix) and len(f) > len(prefix) + len(suffix)}
    return reserved


def check_segment_spec(spec) -> None:
    """ValueError for a bad ``attention_layer_segments``: its syntax (``trl_mdi.attention.metrics``), or a segment name
    whose fields would overwrite another signal's.

    >>> check_segment_spec("early:0-3,late:4-7")
    >>> check_segment_spec("balance:0-1")
    Traceback (most recent call last):
    ...
    ValueError: segment name 'balance' is reserved: its field mdi_balance is already a per-rollout field (reserved: all, balance, group_score); rename the segment
    """
    M.check_segment_spec(spec)
    reserved = reserved_segment_names()
    for name in M.explicit_segment_names(spec):
        if name in reserved:
            fields = [f for s in SIGNALS if s.per_segment for f in expand(s, [name])]
            raise ValueError(
                f"segment name {name!r} is reserved: its field {fields[0]} is already a per-rollout field (reserved: "
                f"{', '.join(sorted(reserved))}); rename the segment"
            )


def log_columns(segments: Sequence[str]) -> list[tuple[str, str]]:
    """(field, header) of the attention log's per-rollout table, in table order; per-segment MDI before MDI all."""
    cols: list[tuple[str, str]] = []
    for s in SIGNALS:
        if s.log is None:
            continue
        if s.per_segment:
            cols += [(n, s.log.format(segment=seg)) for n, seg in zip(expand(s, segments), [g for g in segments
                                                                                             if g != "all"])]
        else:
            cols.append((s.name, s.log))
    # "MDI all" reads best after the per-segment columns
    mdi_all = cols.pop(next(i for i, (k, _) in enumerate(cols) if k == "mdi"))
    last_seg = max((i for i, (k, _) in enumerate(cols) if k.startswith("mdi_") and k != "mdi_balance"), default=-1)
    cols.insert(last_seg + 1, mdi_all)
    return cols


def log_means(segments: Sequence[str]) -> list[tuple[str, str]]:
    """(field, label) of the attention log's step summary: every metric signal, with its column label if it has one."""
    out = []
    for s in SIGNALS:
        if s.metric:
            segs = [g for g in segments if g != "all"]
            label = s.log or s.label or s.name.replace("_", " ")
            labels = [label.format(segment=g) for g in segs] if s.per_segment else [label]
            out += list(zip(expand(s, segments), labels))
    return out


def glossary() -> list[tuple[str, str]]:
    """(metric name, meaning) of every attention/* metric, for the docs' metric glossary."""
    rows = [(f"attention/{s.name.replace('{segment}', '<segment>')}", s.help) for s in SIGNALS if s.metric]
    return rows + list(BATCH_METRICS.items())


# ------------------------------------------------------------------------------------------------ values
def rollout_signals(attention: ModalityAttention, segments_spec, balance_ratio: float) -> dict[str, torch.Tensor]:
    """Every per-rollout signal of these rollouts as ``{name: (B,) float tensor}`` (group signals excepted)."""
    seg = attention.segment_metrics(segments_spec)
    out: dict[str, torch.Tensor] = {}
    for s in SIGNALS:
        if s.compute is None:
            continue
        names = [n for n in seg if n != "all"] if s.per_segment else ["all"]
        for name in names:
            key = s.name.format(segment=name) if s.per_segment else s.name
            out[key] = s.compute(SignalInputs(attention, seg[name], balance_ratio)).float()
    return out


def attach_signals(attention: ModalityAttention, rows: list[dict], *, segments_spec, balance_ratio: float,
                   expected_layers: list[int], gather: Callable[[torch.Tensor], torch.Tensor],
                   local: Callable[[torch.Tensor], torch.Tensor], group_size: int,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Compute this process's signals, add the reward fields to every row (TRL hands row keys to reward functions),
    and return ``(local signals, attention/* metrics of the gathered batch)``. All processes must call it.

    ``gather`` concatenates a (B, K) tensor over processes, ``local`` takes this process's rows back out of an
    (N_global,) one; group signals are computed over the gathered batch because groups can span processes.
    ``expected_layers`` are the softmax layers the model's config predicts: measuring others is an error (a
    config whose ``layer_types`` this project does not understand), not a silent mislabelling.
    """
    if attention.layers != list(expected_layers):
        raise RuntimeError(
            f"the attention probe measured layers {attention.layers} but the model's config predicts softmax attention "
            f"in layers {list(expected_layers)}: its layer_types are not understood (please report it with the model "
            "id); set compute_attention_metrics=False to train without metrics"
        )
    values = rollout_signals(attention, segments_spec, balance_ratio)
    names = list(values)
    table = gather(torch.stack([values[n] for n in names], dim=1))
    gathered = {n: table[:, i] for i, n in enumerate(names)}
    for name, column in group_signals(gathered, group_size).items():
        values[name] = local(column)
    fields = field_names(list(attention.segments(segments_spec)), reward=True)
    for row, field_values in zip(rows, rollout_rows({n: values[n] for n in fields})):
        row.update(field_values)
    return values, batch_metrics(gathered)


def attach_reliance(values: dict[str, torch.Tensor], rows: list[dict] | None, *,
                    gather: Callable[[torch.Tensor], torch.Tensor], local: Callable[[torch.Tensor], torch.Tensor],
                    group_size: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The reliance counterpart of :func:`attach_signals`: ``values`` are this process's counterfactual signals
    (``trl_mdi.counterfactual.reliance_signals``, (B,) each); adds the group score ``answer_visual_gain_group_score``
    (ranked over the gathered batch: groups can span processes), writes every reliance field into ``rows`` (None
    where undefined; ``rows`` None: logs only) and returns ``(local values, reliance/* metrics)``:

    ``reliance/blind_agree_rate`` (the share of answered rollouts whose answer the counterfactual would have given:
    the number to watch), ``reliance/visual_gain``, ``reliance/answer_visual_gain``,
    ``reliance/answer_image_attention`` (means where defined) and ``reliance/answer_rate`` (the share of rollouts
    with an image and an answer line: it falls when a policy games the gain with junk). All processes must call it.
    """
    names = [n for n in RELIANCE_SIGNALS if n in values]
    device = values[names[0]].device
    table = gather(torch.stack([values[n].float().to(device) for n in names], dim=1))
    gathered = {n: table[:, i] for i, n in enumerate(names)}
    score = group_rank_score(gathered["answer_visual_gain"], group_size, higher_is_better=True)
    out = dict(values)
    out["answer_visual_gain_group_score"] = local(score).float()
    if rows is not None:
        for row, fields in zip(rows, rollout_rows({n: out[n] for n in RELIANCE_FIELDS if n in out})):
            row.update(fields)
    metrics = {"reliance/answer_rate": float((~gathered["answer_visual_gain"].isnan()).float().mean())}
    labels = {"blind_agrees": "reliance/blind_agree_rate"}
    for name, column in gathered.items():
        finite = column[torch.isfinite(column)]
        if finite.numel():
            metrics[labels.get(name, f"reliance/{name}")] = float(finite.mean())
    return out, metrics


def group_signals(gathered: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """Signals over whole groups of the gathered batch (groups can span processes): ``mdi_group_score``."""
    return {"mdi_group_score": group_relative_mdi_score(gathered["mdi"], group_size)}


def batch_metrics(gathered: dict[str, torch.Tensor]) -> dict[str, float]:
    """attention/* from the gathered table: each metric signal's mean where finite, plus ``BATCH_METRICS``."""
    signals = {name: signal_of(name) for name in gathered}
    mdi_names = [n for n, s in signals.items() if s is not None and s.name in ("mdi", "mdi_{segment}")]
    values = {
        "attention/rows_without_image": float((gathered["n_image"] == 0).float().mean()),
        "attention/rows_unmeasured": float((gathered["n_queries"] == 0).float().mean()),
        "attention/rows_mdi_inf": float(torch.stack([torch.isinf(gathered[n]) for n in mdi_names]).any(0)
                                        .float().mean()),
    }
    for name, signal in signals.items():
        if signal is not None and signal.metric:
            v = gathered[name][torch.isfinite(gathered[name])]
            if v.numel():
                values[f"attention/{name}"] = float(v.mean())
    return values


def as_python(value) -> float | None:
    """One rollout's value for rewards and logs: a float, or None where undefined (NaN)."""
    v = float(value)
    return None if math.isnan(v) else v


def rollout_rows(table: dict[str, torch.Tensor]) -> list[dict[str, float | None]]:
    """The table as one plain dict per rollout (NaN -> None), the form rewards and logs consume."""
    names = list(table)
    columns = [table[n].tolist() for n in names]
    return [{n: (None if isinstance(v, float) and math.isnan(v) else v) for n, v in zip(names, row)}
            for row in zip(*columns)]


# ------------------------------------------------------------------------------------------------ group score
def split_groups(x: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N, ...) -> (N / G, G, ...): the rollouts of each prompt together (TRL's sampler puts them consecutively).

    >>> split_groups(torch.arange(4), 2).tolist()
    [[0, 1], [2, 3]]
    """
    if num_generations < 1 or x.shape[0] % num_generations:
        raise ValueError(f"{x.shape[0]} rollouts do not split into groups of num_generations={num_generations}")
    return x.reshape(x.shape[0] // num_generations, num_generations, *x.shape[1:])


def group_relative_mdi_score(mdi: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Rank-based MDI balance within each group of rollouts of the same prompt, in [-1, 1].

    Why: the brief's reward ``2 * clip(1 - |log MDI| / log R, 0, 1) - 1`` is the same -1 for every
    MDI outside (1/R, R). Typical MDI is 5-17, so usually the whole group sits outside, the reward is
    constant within the group and its GRPO advantage is zero: no signal. Ranking |log MDI| inside the
    group always separates rollouts, whatever the absolute level.

    ``mdi`` is (N,) with the ``num_generations`` rollouts of one prompt consecutive (TRL's sampler
    order; gather across processes first, groups can span them). Within a group, with rank_i the
    0-based ascending rank of |log MDI_i| among the valid rollouts (ties get their average rank):

        score_i = 1 - 2 * rank_i / (n_valid - 1)

    so the most balanced rollout gets 1, the least -1, and the scores of a group sum to zero. NaN MDI
    (no image tokens) or a negative one gets NaN and is left out of the ranking; a group with one
    valid rollout gives it 0. MDI 0 or inf count as maximally unbalanced (|log MDI| = inf, tied).
    Only the order matters: a tiny MDI difference earns the full spread, so weight it accordingly.

    >>> group_relative_mdi_score(torch.tensor([8.0, 2.0, 16.0, 4.0, 5.0, 5.0, float("nan"), 1.0]), 4)
    tensor([-0.3333,  1.0000, -1.0000,  0.3333, -0.5000, -0.5000,     nan,  1.0000])
    """
    if mdi.dim() != 1:
        raise ValueError(f"mdi must be 1-D (N,), got shape {tuple(mdi.shape)}")
    dtype = mdi.dtype if mdi.is_floating_point() else torch.float32
    return group_rank_score(mdi.double().log().abs(), num_generations, higher_is_better=False).to(dtype)


def group_rank_score(values: torch.Tensor, num_generations: int, *, higher_is_better: bool) -> torch.Tensor:
    """Rank of each value inside its group of ``num_generations`` consecutive rollouts, mapped to [-1, 1]:
    ``1 - 2 * rank / (n_valid - 1)`` with rank 0 for the best (ties share their average rank), so a group's scores
    sum to zero. NaN values get NaN and leave the ranking; a group with one valid value gives it 0.

    >>> group_rank_score(torch.tensor([1.0, 3.0, 2.0, float("nan")]), 4, higher_is_better=True)
    tensor([-1.,  1.,  0., nan], dtype=torch.float64)
    """
    # Ascending ranks of the "cost": the value itself when lower is better, its negation when higher is.
    x = split_groups(-values.double() if higher_is_better else values.double(), num_generations)  # (groups, G)
    valid = ~x.isnan()
    xi, xj, valid_j = x.unsqueeze(-1), x.unsqueeze(-2), valid.unsqueeze(-2)
    below = ((xj < xi) & valid_j).sum(-1).double()
    tied = ((xj == xi) & valid_j).sum(-1).double()  # counts itself when valid
    rank = below + (tied - 1) / 2
    n_valid = valid.sum(-1, keepdim=True).double()
    score = torch.where(n_valid > 1, 1 - 2 * rank / (n_valid - 1).clamp(min=1), torch.zeros_like(rank))
    score = torch.where(valid, score, torch.full_like(score, math.nan))
    return score.reshape(-1)

