"""Per-rollout signals: the one module that names and computes every value the trainer derives per rollout.

``SIGNALS`` is the table. Each entry names its *source*, the record it is computed from:

* ``"probe"``: the attention probe's result over the policy forward (:class:`ProbeInputs`: the
  ``ModalityAttention``, the metrics of one layer segment, the balance ratio R): MDI, AEI, masses, counts;
* ``"counterfactual"``: the same rollouts scored once more with a counterfactual image (:class:`CounterfactualInputs`:
  both passes' completion log-probs, where each rollout wrote its answer, the counterfactual's choice-letter logits,
  the probe's per-token image mass when it ran): ``visual_gain``, ``answer_visual_gain``, ``blind_agrees``...;
* ``"group"``: the batch gathered from every process (:class:`GroupInputs`; a group of rollouts can span processes):
  ranks within each prompt's group, such as ``mdi_group_score``.

and says where the value goes: handed to reward functions as a named argument (``reward``), logged as
``attention/<name>`` (probe) or ``reliance/<name>`` (counterfactual) (``metric``: the mean over the generation
batch where finite; a 0/1 ``flag`` makes it a rate), shown as a column of its log (``log``: the attention log for
probe signals, the rollout log for counterfactual ones), where a rollout that follows the language prior lies
(``direction``, for ``trl_mdi.profile.validation``'s AUROC), and its glossary line (``help``). A name holding ``{segment}``
stands for one value per layer segment (``mdi_{segment}`` -> ``mdi_early``, ``mdi_middle``, ``mdi_late``).
Everything else reads this table: the trainer (which forwards feed it, reward fields, metrics), the reward-input
check at construction, the run plan (a reward reading a counterfactual field turns the counterfactual forward on),
the live logs (columns, summaries), the profile's reliance report, ``trl_mdi.profile.validation`` (directions) and the docs'
glossary (tests/test_readme.py checks it).

Adding a signal is one entry here plus its test: docs/signals.md shows one of each source.

Probe values are computed over the *measured* layers (softmax attention; a hybrid model's linear layers are left
out). A rollout without image tokens has NaN MDI / AEI / balance and NaN counterfactual signals, which reward
functions receive as None. A segment whose layers give the image exactly zero attention (a sliding window hiding
every image key) has MDI = +inf: it leaves the metric means and is counted in ``attention/rows_mdi_inf``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import counterfactual as C
from .attention import ModalityAttention
from .attention import metrics as M
from .tprl import fit_width

PROBE, COUNTERFACTUAL, GROUP = "probe", "counterfactual", "group"
"""The sources a signal is computed from (``Signal.source``)."""

METRIC_PREFIX = {PROBE: "attention", COUNTERFACTUAL: "reliance", GROUP: "attention"}
QUANTILES = (0.1, 0.5, 0.9)
"""The per-step spread of every metric signal that is not a flag, logged as ``<metric>/p10``, ``/p50``, ``/p90``."""
EVIDENCE_COLUMN = "image_evidence"
"""The completions table's text column of the image-evidence tokens (the counterfactual forward's per-token gains)."""
LOW, HIGH = "low", "high"
"""``Signal.direction``: the signal's value at which a rollout follows the language prior rather than the image."""


# ------------------------------------------------------------------------------------------------ the forwards' records
@dataclass
class PolicyForward:
    """What the policy forward over prompt + completion measured (TRL's old-log-prob forward, the training forward,
    or the trainer's own): the record the trainer builds and the probe and counterfactual signals read. Local rows,
    TRL's order.

    ``attention``: the probe's result (None with attention metrics off); ``logps`` / ``entropies``: the completion's
    log-probs under the real image and the token entropies, (B, C), when read; ``perception``: the per-token
    perception signals computed this batch, by kind (``"perturbation"``, ``"attention"``), (B, C) each.
    """

    attention: ModalityAttention | None = None
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    perception: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def measured(cls, attention: ModalityAttention | None, completion_length: int, logps=None,
                 entropies=None) -> PolicyForward:
        """A probed forward's record, with the attention perception signal a_t (B, C) when the probe kept per-token
        image masses (the one place it is read off the probe)."""
        forward = cls(attention=attention, logps=logps, entropies=entropies)
        if attention is not None and attention.query_image_mass is not None:
            forward.perception["attention"] = attention.attention_signal(completion_length)
        return forward


@dataclass(frozen=True)
class CounterfactualForward:
    """What the counterfactual forward measured (``RunPlan.counterfactual``; local rows, TRL's order): the completion's
    log-probs with the counterfactual image I', (B, C); the counterfactual's logits of the row's choice letters at
    the position that chose the answer letter, (B, K) (None: not read); and where each rollout wrote its answer
    (``trl_mdi.answer_tokens.AnswerTokens``)."""

    logps: torch.Tensor
    choice_logits: torch.Tensor | None
    answers: Any


# ------------------------------------------------------------------------------------------------ what signals read
@dataclass(frozen=True)
class ProbeInputs:
    """What a probe signal is computed from: the probe's result, the metrics of one layer segment (all measured
    layers for a signal without ``{segment}``), and the balance ratio R."""

    attention: ModalityAttention
    segment: dict[str, torch.Tensor]  # M.segment_metrics of one segment: mdi, aei_text, aei_image, *_mass
    balance_ratio: float


@dataclass(frozen=True)
class CounterfactualInputs:
    """What a counterfactual signal is computed from (local rows, TRL's order; B rollouts, C completion tokens, K
    choice letters): the policy forward's and the counterfactual forward's records side by side. Build it with
    :meth:`of`, which brings every (B, C) tensor to the completion mask's width.

    ``logps`` / ``cf_logps``: the sampled tokens' log-probs with the real image I and with the counterfactual I';
    ``answers``: where each rollout wrote its answer (``trl_mdi.answer_tokens.AnswerTokens``); ``choice_logits``:
    the counterfactual's logits of the row's choice letters at the position that chose the answer letter (None: not
    read); ``attention``: the probe's per-token image mass a_t (None: attention metrics off)."""

    logps: torch.Tensor  # (B, C) float32
    cf_logps: torch.Tensor  # (B, C) float32
    completion_mask: torch.Tensor  # (B, C)
    answers: Any  # trl_mdi.answer_tokens.AnswerTokens
    choice_logits: torch.Tensor | None  # (B, K)
    has_image: torch.Tensor  # (B,) bool
    attention: torch.Tensor | None = None  # (B, C)

    @classmethod
    def of(cls, policy: PolicyForward, counterfactual: CounterfactualForward, completion_mask: torch.Tensor,
           has_image: torch.Tensor) -> CounterfactualInputs:
        """The record of both forwards on the policy log-probs' device, every (B, C) tensor cut or padded to the
        mask's width (TRL pads a batch's completions to its longest; a forward may have kept fewer positions); the
        probe's per-token image mass is the policy forward's attention perception signal, when it ran."""
        width = completion_mask.shape[1]
        logps = fit_width(policy.logps.float(), width)
        device = logps.device
        attention, choice_logits = policy.perception.get("attention"), counterfactual.choice_logits
        return cls(logps=logps, cf_logps=fit_width(counterfactual.logps.float().to(device), width),
                   completion_mask=completion_mask.to(device), answers=counterfactual.answers,
                   choice_logits=None if choice_logits is None else choice_logits.to(device),
                   has_image=has_image.bool().to(device),
                   attention=None if attention is None else fit_width(attention.float().to(device), width))

    @property
    def token_gain(self) -> torch.Tensor:
        """(B, C) per-token visual gain ``g_t = log p(y_t | I) - log p(y_t | I')``, NaN outside the completion and on
        rows without an image."""
        valid = (self.completion_mask != 0) & self.has_image[:, None]
        return torch.where(valid, self.logps - self.cf_logps, torch.full_like(self.logps, math.nan))

    @property
    def answer_span(self) -> torch.Tensor:
        """(B, C) bool: the answer's tokens inside the completion."""
        span = self.answers.span_mask.to(self.logps.device)
        return fit_width(span, self.completion_mask.shape[1]).bool() & (self.completion_mask != 0)

    def at_answer_letter(self, values: torch.Tensor) -> torch.Tensor:
        """(B,) ``values[b, t]`` at the position t that wrote rollout b's answer letter; NaN without one (or image)."""
        position = self.answers.letter_position.to(values.device)
        picked = values.gather(1, position.clamp(min=0)[:, None])[:, 0]
        return torch.where((position >= 0) & self.has_image, picked, torch.full_like(picked, math.nan))


@dataclass(frozen=True)
class GroupInputs:
    """What a group signal is computed from: every process's values, gathered (N_global,), with the rollouts of a
    prompt consecutive (TRL's sampler order), and the group size."""

    gathered: dict[str, torch.Tensor]
    group_size: int


@dataclass(frozen=True)
class Signal:
    name: str  # field name; "{segment}" expands to one value per layer segment (probe signals)
    help: str  # one line: the glossary, the registry help
    compute: Callable[[Any], torch.Tensor | None]  # source's inputs -> (B,) (group: (N_global,)); None: not defined
    source: str = PROBE  # PROBE, COUNTERFACTUAL or GROUP: the record ``compute`` reads
    reward: bool = False  # handed to reward functions as a named argument
    metric: bool = False  # logged as <attention|reliance>/<name>: mean over rollouts where finite
    log: str | None = None  # column header of its log (attention log: probe; rollout log: counterfactual)
    label: str | None = None  # its step-summary row: attention log, when no column (default: log); rollout log
    # (default: "<log> mean", "<log> rate" for a flag; trl_mdi.diagnostics.writers.summary_label)
    direction: str | None = None  # LOW / HIGH: where prior-following rollouts lie (trl_mdi.profile.validation); None: unknown
    reads: tuple[str, ...] = ()  # group: the signals it ranks; counterfactual: PROBE when it needs the probe too
    flag: bool = False  # a 0/1 verdict: its metric is a rate, its log cell yes / no
    metric_name: str | None = None  # the metric's name when not <prefix>/<name>
    words: Callable[[float | None], str] | None = None  # the full rollout's reliance line (counterfactual)

    @property
    def per_segment(self) -> bool:
        return "{segment}" in self.name

    @property
    def metric_key(self) -> str:
        """The logged metric's name (``<name>`` with ``{segment}`` as ``<segment>`` for the glossary)."""
        return self.metric_name or f"{METRIC_PREFIX[self.source]}/{self.name.replace('{segment}', '<segment>')}"


def _layer_mean(x: ProbeInputs, group: str) -> torch.Tensor:
    return getattr(x.attention, group)[:, x.attention.layers].mean(dim=1)


def _row_max(values: torch.Tensor) -> torch.Tensor:
    """(B,) the largest finite value of each row of (B, C) ``values`` (NaN marks positions that do not count); NaN
    for a row without one."""
    finite = torch.isfinite(values)
    best = torch.where(finite, values, torch.full_like(values, -math.inf)).amax(dim=1)
    return torch.where(finite.any(dim=1), best, torch.full_like(best, math.nan))


def _span_sum(values: torch.Tensor, span: torch.Tensor, has_image: torch.Tensor) -> torch.Tensor:
    """(B,) the sum of ``values`` over each row's span; NaN for a row without a span or an image."""
    valid = span & has_image[:, None]
    total = torch.where(valid, values, torch.zeros_like(values)).sum(dim=1)
    return torch.where(valid.any(dim=1), total, torch.full_like(total, math.nan))


def _signed(value: float | None) -> str:
    return f"{float(value):+.4g}" if value is not None and math.isfinite(float(value)) else "—"


def _words(label: str, unit: str, missing: str) -> Callable[[float | None], str]:
    """A number's phrase in the full rollout's reliance line: ``"visual gain +0.31 nats per token"``."""
    return lambda v: f"{label} {_signed(v)} {unit}".rstrip() if v is not None else f"{label} — ({missing})"


def _blind_words(v: float | None) -> str:
    if v is None or not math.isfinite(float(v)):
        return "blind answer agrees: — (no answer letter to compare)"
    return ("blind answer agrees: yes (the answer would have been the same without the image)" if v
            else "blind answer agrees: no (without the image the answer would have been different)")


SIGNALS: tuple[Signal, ...] = (
    # ------------------------------------------------------------------ the probe (attention over the policy forward)
    Signal("mdi", "MDI over all measured layers, (A_T / n_T) / (A_O / n_O): > 1 text dominates, < 1 the image does",
           lambda x: x.segment["mdi"], reward=True, metric=True, log="MDI all", direction=HIGH),
    Signal("mdi_{segment}", "MDI of one layer segment (thirds of the measured layers by default: early, middle, late)",
           lambda x: x.segment["mdi"], reward=True, metric=True, log="MDI {segment}", direction=HIGH),
    Signal("aei_text", "attention efficiency of text keys, P_T / Q_T (1 = attention proportional to token count)",
           lambda x: x.segment["aei_text"], reward=True, metric=True, log="AEI text", direction=HIGH),
    Signal("aei_image", "attention efficiency of image keys, P_O / Q_O", lambda x: x.segment["aei_image"],
           reward=True, metric=True, log="AEI vision", direction=LOW),
    Signal("aei_text_{segment}", "AEI of text keys in one layer segment", lambda x: x.segment["aei_text"],
           reward=True, metric=True, label="AEI text {segment}", direction=HIGH),
    Signal("aei_image_{segment}", "AEI of image keys in one layer segment", lambda x: x.segment["aei_image"],
           reward=True, metric=True, label="AEI vision {segment}", direction=LOW),
    Signal("mdi_balance", "balance, clip(1 - |log MDI| / log R, 0, 1): 1 at MDI = 1, 0 outside (1/R, R)",
           lambda x: M.mdi_balance(x.segment["mdi"], x.balance_ratio), reward=True, metric=True, log="balance"),
    Signal("image_mass", "attention mass of the generated tokens on image keys (mean over heads, tokens, layers)",
           lambda x: _layer_mean(x, "image"), metric=True, direction=LOW),
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
    # ------------------------------------------------------------------ the counterfactual forward (docs/reliance.md)
    Signal("visual_gain", "mean over the completion of g_t = log p(y_t | I) - log p(y_t | I'), I' the counterfactual "
           "image (nats per token): > 0 the image made the sampled text likelier",
           lambda x: C.visual_gain(x.logps, x.cf_logps, x.completion_mask, has_image=x.has_image),
           source=COUNTERFACTUAL, reward=True, metric=True, log="vis gain", direction=LOW,
           label="visual gain mean (nats per token)",
           words=_words("visual gain", "nats per token", "no completion token")),
    Signal("visual_gain_sum", "sum of g_t over the completion (nats): the image's evidence in the whole chain, "
           "undiluted by its length",
           lambda x: _span_sum(x.logps - x.cf_logps, x.completion_mask != 0, x.has_image),
           source=COUNTERFACTUAL, reward=True, metric=True, direction=LOW),
    Signal("visual_gain_max", "largest per-token g_t over the completion (nats): where the image entered most "
           "(a perception token such as a colour word read off the image)",
           lambda x: _row_max(x.token_gain), source=COUNTERFACTUAL, reward=True, metric=True, direction=LOW),
    Signal("answer_visual_gain", "sum of g_t over the answer letter's tokens: log p(answer | I) - log p(answer | I') "
           "in nats (pointwise visual information of the answer)",
           lambda x: C.answer_visual_gain(x.logps, x.cf_logps, x.answer_span, has_image=x.has_image),
           source=COUNTERFACTUAL, reward=True, metric=True, log="ans gain", direction=LOW,
           label="answer visual gain mean (nats)", words=_words("answer visual gain", "nats", "no answer line")),
    Signal("blind_agrees", "share of answered rollouts whose letter the counterfactual's own argmax over the choice "
           "letters would have given (the answer would have been the same without the image)",
           lambda x: None if x.choice_logits is None else C.blind_agrees(
               x.choice_logits, x.answers.answer_index.to(x.logps.device), x.answers.n_choices.to(x.logps.device),
               x.has_image),
           source=COUNTERFACTUAL, reward=True, metric=True, log="blind", direction=HIGH, flag=True,
           metric_name="reliance/blind_agree_rate", words=_blind_words,
           label="blind agreement (share of answers unchanged without the image)"),
    Signal("answer_image_attention", "the probe's image mass a_t at the position that wrote the answer letter "
           "(token-layer segment)",
           lambda x: None if x.attention is None else x.at_answer_letter(x.attention),
           source=COUNTERFACTUAL, reward=True, metric=True, direction=LOW, reads=(PROBE,),
           label="image attention at the answer letter mean",
           words=lambda v: f"image attention at the answer letter {v:.4g}" if v is not None else ""),
    Signal("answer_logprob", "log p(answer | I) summed over the answer letter's tokens, with the real image: the "
           "policy's confidence in its answer, a baseline any reliance signal should beat",
           lambda x: _span_sum(x.logps, x.answer_span, x.has_image), source=COUNTERFACTUAL, metric=True,
           direction=LOW),
    # ------------------------------------------------------------------ groups, over the batch gathered
    Signal("mdi_group_score", "rank of |log MDI| within the rollout's group, 1 (most balanced) to -1, zero-mean",
           lambda g: group_relative_mdi_score(g.gathered["mdi"], g.group_size), source=GROUP, reward=True,
           reads=("mdi",)),
    Signal("answer_visual_gain_group_score", "rank of answer_visual_gain within the rollout's group, 1 (largest) to "
           "-1, zero-mean",
           lambda g: group_rank_score(g.gathered["answer_visual_gain"], g.group_size, higher_is_better=True).float(),
           source=GROUP, reward=True, reads=("answer_visual_gain",)),
)

# Batch-level counts logged beside the means, computed from the gathered values of their source.
BATCH_METRICS: dict[str, str] = {
    "attention/rows_without_image": "fraction of rollouts without image tokens (no MDI)",
    "attention/rows_unmeasured": ("fraction of rollouts with no generated token to measure: an empty completion, or "
                                  "one cut off at `max_completion_length` when the probe rides one of TRL's own "
                                  "forwards (under vLLM, or in the training forward) with `mask_truncated_completions` "
                                  "on, the default: TRL masks such a completion out of its forwards, so its MDI is "
                                  "empty and `mdi_balance` gives it no reward (the trainer's own extra forward measures "
                                  "it)"),
    "attention/rows_mdi_inf": "fraction of rollouts in which some segment (or all layers) gives the image exactly zero "
                              "attention: that MDI is +inf and leaves its segment's mean (e.g. a sliding window that "
                              "hides every image key)",
    "reliance/answer_rate": "fraction of rollouts with an image and an answer line (an answer_visual_gain): it falls "
                            "when a policy games the gain with junk",
}


# ------------------------------------------------------------------------------------------------ names
def expand(signal: Signal, segments: Sequence[str]) -> list[str]:
    """The field names of one signal for the given segment names (``"all"`` excluded from per-segment names)."""
    if not signal.per_segment:
        return [signal.name]
    return [signal.name.format(segment=s) for s in segments if s != "all"]


def field_names(segments: Sequence[str], *, reward: bool | None = None, forwards: Sequence[str] = (PROBE,),
                ) -> list[str]:
    """Every per-rollout field for these segments that the given forwards provide (``reward=True``: those handed to
    reward functions). The default is the attention probe's fields (and the group signals ranking them).

    >>> field_names(["late"], reward=True)
    ['mdi', 'mdi_late', 'aei_text', 'aei_image', 'aei_text_late', 'aei_image_late', 'mdi_balance', 'mdi_group_score']
    >>> [n for n in field_names([], reward=True, forwards=[PROBE, COUNTERFACTUAL]) if not reward_field_pattern(n)]
    ['visual_gain', 'visual_gain_sum', 'visual_gain_max', 'answer_visual_gain', 'blind_agrees', 'answer_image_attention', 'answer_visual_gain_group_score']
    """
    return [n for s in SIGNALS if (reward is None or s.reward == reward) and needed_forwards(s) <= set(forwards)
            for n in expand(s, segments)]


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


def needed_forwards(signal: Signal) -> frozenset[str]:
    """The forwards a signal needs (``PROBE``, ``COUNTERFACTUAL``): its source and what it reads; for a group
    signal, what the signals it ranks need."""
    if signal.source == GROUP:
        return frozenset().union(*(sources_of(n) for n in signal.reads))
    return frozenset({signal.source, *(r for r in signal.reads if r in (PROBE, COUNTERFACTUAL))})


def sources_of(name: str) -> frozenset[str]:
    """The forwards the field ``name`` needs (:func:`needed_forwards`); empty for a name that is no signal.

    >>> sorted(sources_of("answer_image_attention")), sorted(sources_of("mdi_group_score")), sources_of("x")
    (['counterfactual', 'probe'], ['probe'], frozenset())
    """
    signal = signal_of(name)
    return needed_forwards(signal) if signal is not None else frozenset()


def reliance_names() -> list[str]:
    """The counterfactual signals (``source="counterfactual"``), in table order: the rollout log's reliance fields."""
    return [s.name for s in SIGNALS if s.source == COUNTERFACTUAL]


def counterfactual_fields() -> list[str]:
    """Every field that needs the counterfactual forward: its signals and the group signals ranking them."""
    return [s.name for s in SIGNALS if COUNTERFACTUAL in needed_forwards(s)]


def trainer_field(name: str) -> bool:
    """Whether a reward input named ``name`` is a per-rollout field the trainer computes (attention or reliance),
    not a dataset column.

    >>> trainer_field("mdi_late"), trainer_field("blind_agrees"), trainer_field("label_idx")
    (True, True, False)
    """
    signal = signal_of(name)
    return signal is not None and signal.reward


def reward_field_pattern(name: str) -> bool:
    """Whether a reward input named ``name`` is (for some segment names) a reward field of the attention probe
    alone (its own signals, and the groups ranking them).

    >>> reward_field_pattern("mdi_late"), reward_field_pattern("aei_text"), reward_field_pattern("label_idx")
    (True, True, False)
    """
    return trainer_field(name) and sources_of(name) == {PROBE}


def reads_attention(name: str) -> bool:
    """Whether a reward input of this name needs the attention probe (``mdi*``, ``aei*``, ``answer_image_attention``).

    >>> reads_attention("answer_image_attention"), reads_attention("visual_gain")
    (True, False)
    """
    return trainer_field(name) and PROBE in sources_of(name)


def reads_counterfactual(name: str) -> bool:
    """Whether a reward input of this name needs the counterfactual forward (the reliance fields)."""
    return trainer_field(name) and COUNTERFACTUAL in sources_of(name)


def provided_fields(segments: Sequence[str], *, attention: bool, counterfactual: bool) -> set[str]:
    """The reward fields a run provides: the probe's (for these segments) with attention metrics on, the
    counterfactual ones when the counterfactual forward can run (those also reading the probe need attention too),
    and the group signals whose inputs are provided."""
    forwards = ({PROBE} if attention else set()) | ({COUNTERFACTUAL} if counterfactual else set())
    return set(field_names(segments, reward=True, forwards=forwards))


def direction(name: str) -> str | None:
    """Where a signal points to prior-following rollouts: ``LOW``, ``HIGH`` or None (not in the table, or peaked,
    such as ``mdi_balance``).

    >>> direction("visual_gain"), direction("mdi_late"), direction("mdi_balance"), direction("confidence")
    ('low', 'high', None, None)
    """
    signal = signal_of(name)
    return signal.direction if signal is not None else None


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


# ------------------------------------------------------------------------------------------------ the logs' views
def log_columns(segments: Sequence[str]) -> list[tuple[str, str]]:
    """(field, header) of the attention log's per-rollout table (probe signals), in table order; per-segment MDI
    before MDI all."""
    cols: list[tuple[str, str]] = []
    for s in SIGNALS:
        if s.log is None or s.source != PROBE:
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
    """(field, label) of the attention log's step summary: every probe metric, with its column label if it has one."""
    out = []
    for s in SIGNALS:
        if s.metric and s.source == PROBE:
            segs = [g for g in segments if g != "all"]
            label = s.log or s.label or s.name.replace("_", " ")
            labels = [label.format(segment=g) for g in segs] if s.per_segment else [label]
            out += list(zip(expand(s, segments), labels))
    return out


def rollout_log_columns() -> list[tuple[str, str]]:
    """(field, header) of the rollout log's reliance columns: the counterfactual signals with a ``log`` header."""
    return [(s.name, s.log) for s in SIGNALS if s.source == COUNTERFACTUAL and s.log is not None]


def rollout_log_cell(name: str, value: Any) -> Any:
    """A reliance cell of the rollout log: a flag as yes / no, a number as it is, None where undefined."""
    signal = signal_of(name)
    if value is None or not math.isfinite(float(value)):
        return None
    return bool(value) if signal is not None and signal.flag else value


def reliance_words(rollout: dict) -> list[str]:
    """The full rollout's reliance line, one phrase per counterfactual signal the rollout carries (table order)."""
    out = []
    for s in SIGNALS:
        if s.source == COUNTERFACTUAL and s.words is not None and s.name in rollout:
            phrase = s.words(rollout[s.name])
            if phrase:
                out.append(phrase)
    return out


def glossary() -> list[tuple[str, str]]:
    """(metric name, meaning) of every attention/* and reliance/* metric, for the docs' metric glossary."""
    return [(s.metric_key, s.help) for s in SIGNALS if s.metric] + list(BATCH_METRICS.items())


# ------------------------------------------------------------------------------------------------ values
def rollout_signals(attention: ModalityAttention, segments_spec, balance_ratio: float) -> dict[str, torch.Tensor]:
    """Every probe signal of these rollouts as ``{name: (B,) float tensor}``."""
    seg = attention.segment_metrics(segments_spec)
    out: dict[str, torch.Tensor] = {}
    for s in SIGNALS:
        if s.source != PROBE:
            continue
        names = [n for n in seg if n != "all"] if s.per_segment else ["all"]
        for name in names:
            key = s.name.format(segment=name) if s.per_segment else s.name
            out[key] = s.compute(ProbeInputs(attention, seg[name], balance_ratio)).float()
    return out


def counterfactual_signals(inputs: CounterfactualInputs) -> dict[str, torch.Tensor]:
    """Every counterfactual signal of these rollouts as ``{name: (B,) float tensor}``, NaN where undefined; a signal
    whose inputs were not read (no choice logits, no probe) is left out."""
    out = {}
    for s in SIGNALS:
        if s.source == COUNTERFACTUAL:
            value = s.compute(inputs)
            if value is not None:
                out[s.name] = value.float()
    return out


def check_measured_layers(attention: ModalityAttention, expected_layers: Sequence[int]) -> None:
    """RuntimeError when the probe measured other layers than the model's config predicts: a config whose
    ``layer_types`` this project does not understand, never a silent mislabelling."""
    if attention.layers != list(expected_layers):
        raise RuntimeError(
            f"the attention probe measured layers {attention.layers} but the model's config predicts softmax attention "
            f"in layers {list(expected_layers)}: its layer_types are not understood (please report it with the model "
            "id); set compute_attention_metrics=False to train without metrics"
        )


def rollout_values(*, attention: ModalityAttention | None = None, counterfactual: CounterfactualInputs | None = None,
                   segments_spec=None, balance_ratio: float = 2.0) -> dict[str, torch.Tensor]:
    """This process's per-rollout values from the records that ran (the probe's result, both forwards' record for
    the counterfactual signals): ``{name: (B,) float32 CPU tensor}``, group signals excepted (:func:`batch_signals`)."""
    values = rollout_signals(attention, segments_spec, balance_ratio) if attention is not None else {}
    if counterfactual is not None:
        values.update(counterfactual_signals(counterfactual))
    return {n: v.detach().float().cpu() for n, v in values.items()}


@dataclass(frozen=True)
class BatchSignals:
    """A generation batch's per-rollout values and metrics: ``local`` (this process's rows, (B,) each, group signals
    included), ``metrics`` (``attention/*``, ``reliance/*`` of the batch gathered from every process: computed once
    here, read by the trainer's log and the live logs alike), ``counterfactual`` (the record the counterfactual
    signals were computed from, None without the counterfactual forward: the live logs read its per-token gains) and
    ``gathered`` (every value of the batch, all processes, in process order: TRL's completions table's order)."""

    local: dict[str, torch.Tensor]
    metrics: dict[str, float]
    counterfactual: CounterfactualInputs | None = None
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)  # every process's rows, (N_global,) each

    def reward_rows(self) -> list[dict[str, float | None]]:
        """One dict per local rollout of the reward fields (None where undefined): what rewards read by name."""
        return rollout_rows({n: v for n, v in self.local.items() if trainer_field(n)})


def batch_signals(policy: PolicyForward, counterfactual: CounterfactualForward | None, *, completion_mask: torch.Tensor,
                  has_image: torch.Tensor, segments_spec, balance_ratio: float,
                  gather: Callable[[torch.Tensor], torch.Tensor], local: Callable[[torch.Tensor], torch.Tensor],
                  group_size: int) -> BatchSignals:
    """The batch's signals from the forwards' records (the counterfactual's None when it did not run): this process's
    values (:func:`rollout_values`), gathered in one collective, the group signals added (a group can span
    processes), and the metrics computed. All processes must call it.

    ``completion_mask`` (B, C) and ``has_image`` (B,) are the batch's; ``gather`` concatenates a (B, K) tensor over
    processes; ``local`` takes this process's rows back out of an (N_global,) one.
    """
    inputs = (CounterfactualInputs.of(policy, counterfactual, completion_mask, has_image)
              if counterfactual is not None else None)
    values = rollout_values(attention=policy.attention, counterfactual=inputs, segments_spec=segments_spec,
                            balance_ratio=balance_ratio)
    names = list(values)
    if not names:
        return BatchSignals({}, {}, inputs)
    table = gather(torch.stack([values[n] for n in names], dim=1))
    gathered = {n: table[:, i] for i, n in enumerate(names)}
    out = dict(values)
    for name, column in group_signals(gathered, group_size).items():
        gathered[name] = column
        out[name] = local(column).float()
    return BatchSignals(out, batch_metrics(gathered), inputs, gathered)


def group_signals(gathered: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """The group signals whose inputs were gathered (``mdi_group_score``, ``answer_visual_gain_group_score``...)."""
    out = {}
    for s in SIGNALS:
        if s.source == GROUP and all(n in gathered for n in s.reads):
            out[s.name] = s.compute(GroupInputs(gathered, group_size))
    return out


def batch_metrics(gathered: dict[str, torch.Tensor]) -> dict[str, float]:
    """attention/* and reliance/* from the gathered values: each metric signal's mean where finite (a flag's mean is
    its rate), plus the ``BATCH_METRICS`` of the sources present."""
    signals = {name: signal_of(name) for name in gathered}
    values: dict[str, float] = {}
    if "n_image" in gathered:
        mdi_names = [n for n, s in signals.items() if s is not None and s.name in ("mdi", "mdi_{segment}")]
        values["attention/rows_without_image"] = float((gathered["n_image"] == 0).float().mean())
        values["attention/rows_unmeasured"] = float((gathered["n_queries"] == 0).float().mean())
        values["attention/rows_mdi_inf"] = float(torch.stack([torch.isinf(gathered[n]) for n in mdi_names]).any(0)
                                                 .float().mean())
    if "answer_visual_gain" in gathered:
        values["reliance/answer_rate"] = float((~gathered["answer_visual_gain"].isnan()).float().mean())
    for name, signal in signals.items():
        if signal is not None and signal.metric:
            v = gathered[name][torch.isfinite(gathered[name])]
            if v.numel():
                key = signal.metric_name or f"{METRIC_PREFIX[signal.source]}/{name}"
                values[key] = float(v.mean())
                if not signal.flag:
                    values.update(spread_metrics(key, v))
    return values


def spread_metrics(key: str, values: torch.Tensor) -> dict[str, float]:
    """The per-step spread of one metric's finite per-rollout ``values``: ``<key>/p10``, ``/p50``, ``/p90``. Scalars,
    so that every tracker (and TRL's own averaging over ``logging_steps``) takes them as they are; a policy whose
    reliance splits into two modes shows as p10 and p90 drifting apart while the mean stays put.

    >>> spread_metrics("reliance/visual_gain", torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]))
    {'reliance/visual_gain/p10': 0.0, 'reliance/visual_gain/p50': 0.0, 'reliance/visual_gain/p90': 1.0}
    """
    q = torch.quantile(values.double(), torch.tensor(QUANTILES, dtype=torch.double))
    return {f"{key}/p{round(p * 100)}": float(v) for p, v in zip(QUANTILES, q.tolist())}


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

    Why: the balance reward ``2 * clip(1 - |log MDI| / log R, 0, 1) - 1`` is the same -1 for every
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
