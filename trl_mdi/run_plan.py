"""Everything MDIGRPOTrainer decides at construction, in one frozen record printed at start: the run plan.

:func:`plan_run` is the run's one pre-weight phase. The entry point (so that ``--dry_run`` prints it) and
``MDIGRPOTrainer.__init__`` (unless handed the entry point's plan) call it with the same inputs: the model (an id,
a path or a loaded object), the processor, the rewards, the config and the data's columns. It decides the reward
stack and its weights, attention metrics on or off and why, the layer segments, the token layers of the attention
perception signal, what reads attention before the loss, whether the chat template prefills ``<think>``, and what
only the model's modules tell: the attention implementation, where the probe measures (:class:`ProbePlacement`),
whether image-less processes run a dummy vision pass, and so the forwards the trainer adds. The modules are read
off the model's class built on the meta device from its config (no weight is read; a loaded model is read as it
is). A line that cannot be decided so (a custom class that cannot be built without its weights) says so, and the
trainer completes it once the weights load (:meth:`RunPlan.with_model`), which is also where it checks the loaded
model against the plan.

Each decision reads explicit inputs and either returns a value or raises one clear error, so that a TRL script
that works with ``GRPOTrainer`` works unchanged and only a request that cannot be met stops the run. The user's
config object is never written to: :func:`effective_config` gives ``super().__init__`` a copy carrying the plan's
values.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import os
from collections.abc import Sequence
from typing import Any

from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.utils import logging

from .answer_format import template_prefills_think
from .attention import metrics as M
from .attention.model_facts import (
    ModelFacts,
    attention_implementation,
    check_family,
    check_trainable,
    check_zero3_loading,
    check_zero3_training,
    image_token_problem,
    load_model_config,
    model_facts,
    model_skeleton,
    processor_setting_problem,
)
from .attention.probe import NATIVE_IMPLEMENTATIONS, probe_support
from .data.columns import DatasetError
from .filtering import filter_column
from .rewards import (
    DEFAULT_REWARDS,
    bind_think_format,
    default_reward_stack,
    resolve_reward_funcs,
    reward_name,
)
from .rewards.inputs import check_reward_inputs
from .signals import reads_attention, reads_counterfactual
from .vision_pass import vision_pass_problem
from .vllm_prompts import check_vllm_prompts

logger = logging.get_logger(__name__)


class ProbePlacement(str, enum.Enum):
    """Where the attention probe measures each generation batch."""

    OFF = "off"  # attention metrics off
    TRL_FORWARD = "trl_forward"  # inside TRL's no-grad old-log-prob forward: no extra forward
    EXTRA_FORWARD = "extra_forward"  # one extra no-grad forward before the rewards
    TRAINING_FORWARD = "training_forward"  # inside the grad-enabled training forward, slice by slice: no extra forward

    def __str__(self) -> str:
        return self.value


class RewardsFrom(str, enum.Enum):
    """Where a run's rewards come from. The trainer's ``reward_funcs`` argument wins; without it, the config's
    ``reward_funcs`` field (``MDIGRPOConfig``'s default: the 4:1:1 stack); a config without rewards (a plain
    ``GRPOConfig``, upgraded, or ``reward_funcs=None``) leaves them to GRPOTrainer."""

    ARGUMENT = "the trainer's reward_funcs"
    CONFIG = "the config's reward_funcs"
    DEFAULT_STACK = "the default stack"  # the config's reward_funcs are the default stack's names
    NONE = "none given (GRPOTrainer decides)"  # its own error, or an environment_factory's get_reward

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class RewardInputs:
    """What one reward function reads of the trainer's per-rollout fields, from its signature, inspected once
    (:meth:`of`): every named parameter counts, optional ones included (``mdi=None``): a reward reads the signals it
    names. A reward model or Hub id (not a plain callable of named fields) reads none."""

    name: str
    attention_fields: tuple[str, ...]  # fields that need the attention probe (mdi*, aei*, answer_image_attention)
    counterfactual_fields: tuple[str, ...]  # fields that need the counterfactual forward (the reliance signals)

    @classmethod
    def of(cls, func) -> RewardInputs:
        params = list(inspect.signature(func).parameters) if callable(func) else []
        return cls(name=reward_name(func), attention_fields=tuple(n for n in params if reads_attention(n)),
                   counterfactual_fields=tuple(n for n in params if reads_counterfactual(n)))

    @property
    def policy_fields(self) -> tuple[str, ...]:
        """The counterfactual fields that do not read the probe: they need the real image's log-probs before the
        loss, whether or not attention is measured."""
        return tuple(n for n in self.counterfactual_fields if n not in self.attention_fields)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run does, decided once, before the weights load (:func:`plan_run`). The fields from ``placement`` on
    are read off the model's modules; they stay None (``modules_why`` says why) only when the model's class cannot
    be built without its weights, until :meth:`with_model` reads the loaded model."""

    model_name: str
    facts: ModelFacts
    reward_funcs: tuple  # what super().__init__ gets: callables (think_format bound to the answer pattern) and ids
    reward_names: tuple[str, ...]
    reward_weights: tuple[float, ...] | None
    rewards_from: RewardsFrom
    attention_metrics: bool
    attention_why: str
    segment_layers: dict[str, tuple[int, ...]]  # segment -> measured layers ("all" last); {} with metrics off
    token_layers: tuple[int, ...]  # layers of the probe's per-token image mass (attention signal); () when unused
    attention_readers: tuple[str, ...]  # what reads attention before the loss (rewards of mdi*/aei* fields, ...)
    other_readers: tuple[str, ...]  # what else reads the policy forward before the loss (reliance rewards, TPRL)
    attention_requests: tuple[str, ...]  # what explicitly asks for attention (an error where it cannot be measured)
    counterfactual: bool  # the counterfactual forward runs: the reliance signals (docs/reliance.md)
    counterfactual_why: str
    perturbed_forward: bool  # VPPO's perturbed-image forward runs (perturbation signal used or compared)
    shared_counterfactual: bool  # the perturbed forward is the counterfactual forward (same kind): one serves both
    think_prefilled: bool  # the chat template opens <think> in the prompt
    trl_runs_policy_forward: bool  # TRL runs its own no-grad old-log-prob forward per generation batch
    num_processes: int
    # Read off the model's modules (its class built without weights, or the loaded model).
    placement: ProbePlacement | None = None
    placement_why: str = ""
    attn_implementation: str | None = None
    vision_pass: bool | None = None
    vision_pass_why: str = ""
    modules_why: str = ""  # why the fields above wait for the loaded model ("" once read)

    @property
    def segments(self) -> tuple[str, ...]:
        """The per-segment names ("all" excluded): the suffixes of the ``mdi_<segment>`` fields."""
        return tuple(n for n in self.segment_layers if n != "all")

    @property
    def complete(self) -> bool:
        """Whether every line is decided (False only while the modules wait for the loaded model)."""
        return self.placement is not None

    def with_model(self, model, processing_class) -> RunPlan:
        """The decisions read off the model's modules: ``model`` is the class built without weights
        (``model_skeleton``) or the loaded model. Its attention implementation and whether the probe can measure it
        (a model with its own softmax cannot: attention metrics then go, as on a text-only model), where the probe
        measures, and whether the dummy vision pass can hook it."""
        plan = self
        problem = probe_support(model) if self.attention_metrics else None
        if problem:
            plan = self.without_attention(problem)
        attn_implementation = attention_implementation(model)
        placement, why = probe_placement(plan.measures_policy, plan.attention_metrics, plan.read_before_loss,
                                         attn_implementation, plan.trl_runs_policy_forward)
        vision, vision_why = vision_pass_plan(model, processing_class, plan.num_processes, plan.facts.is_vlm)
        return dataclasses.replace(plan, placement=placement, placement_why=why,
                                   attn_implementation=attn_implementation, vision_pass=vision,
                                   vision_pass_why=vision_why, modules_why="")

    def without_attention(self, reason: str) -> RunPlan:
        """The plan with attention metrics off because the model's attention cannot be measured: one warning that
        says why, as for a text-only model; an explicit request for attention is an error naming the reason. The
        default stack loses ``mdi_balance`` (it would score None on every rollout)."""
        requests = [r for r in self.attention_requests]
        if requests:
            raise ValueError(f"{reason}, but {'; '.join(requests)} need(s) its attention. Drop those settings (or use "
                             "a model whose attention runs through transformers' attention interface).")
        logger.warning("MDIGRPOTrainer: %s: attention metrics are off; the trainer behaves as GRPOTrainer", reason)
        names, weights = list(self.reward_names), self.reward_weights
        funcs = list(self.reward_funcs)
        if self.rewards_from is RewardsFrom.DEFAULT_STACK and "mdi_balance" in names:
            i = names.index("mdi_balance")
            del names[i], funcs[i]
            weights = tuple(w for j, w in enumerate(weights) if j != i) if weights is not None else None
        # The one attention reader that can be left is the default stack's mdi_balance (a reward the user named that
        # reads attention is an explicit request, an error above): it left with its reward.
        return dataclasses.replace(self, attention_metrics=False, attention_why=reason, segment_layers={},
                                   token_layers=(), attention_readers=(), reward_funcs=tuple(funcs),
                                   reward_names=tuple(names), reward_weights=weights)

    def batch_placement(self, mode: str) -> ProbePlacement:
        """Where the probe measures a generation batch of this mode (``"train"`` / ``"eval"``): the plan's placement,
        except that an evaluation batch has no training forward to ride, so it is measured in one extra forward."""
        if mode != "train" and self.placement is ProbePlacement.TRAINING_FORWARD:
            return ProbePlacement.EXTRA_FORWARD
        return self.placement

    @property
    def read_before_loss(self) -> tuple[str, ...]:
        """What reads the policy forward of a batch before the loss (its extra forward runs before the rewards)."""
        return self.attention_readers + self.other_readers

    @property
    def measures_policy(self) -> bool:
        """Whether the trainer reads a policy forward over each batch: the probe, the real image's log-probs of the
        reliance signals, TPRL's log-probs and entropies."""
        return self.attention_metrics or self.counterfactual or bool(self.read_before_loss)

    @property
    def extra_forwards(self) -> tuple[str, ...]:
        """The no-grad forwards the trainer adds per generation batch, each with its reason (the first needs the
        placement)."""
        out = []
        if self.placement is ProbePlacement.EXTRA_FORWARD:
            probe = " with the attention probe" if self.attention_metrics else ""
            out.append(f"policy forward{probe} ({self.placement_why})")
        if self.counterfactual:
            shared = " and the perturbation perception signal" if self.shared_counterfactual else ""
            out.append(f"policy forward with the counterfactual image (reliance signals{shared}: "
                       f"{self.counterfactual_why})")
        if self.perturbed_forward and not self.shared_counterfactual:
            out.append("policy forward with perturbed images (the perturbation perception signal)")
        return tuple(out)

    def describe(self) -> str:
        """The plan as printed at start, by the entry point (``--dry_run`` included) and the trainer alike."""
        weights = self.reward_weights or (1.0,) * len(self.reward_names)
        rewards = ", ".join(f"{n} x{w:g}" for n, w in zip(self.reward_names, weights)) or "none"
        lines = [
            ("model", f"{self.model_name} ({self.facts.model_type}): {self.facts.describe_layers()}"),
            ("rewards", f"{rewards} [{self.rewards_from}]"),
            ("attention metrics", f"{'on' if self.attention_metrics else 'off'} ({self.attention_why})"),
        ]
        if self.attention_metrics:
            lines.append(("segments", describe_segments({k: list(v) for k, v in self.segment_layers.items()})))
        lines.append(("reliance signals", f"on ({self.counterfactual_why})" if self.counterfactual else "off"))
        if self.read_before_loss:
            lines.append(("read before the loss by", "; ".join(self.read_before_loss)))
        if self.token_layers:
            lines.append(("per-token image mass layers", ", ".join(map(str, self.token_layers))))
        lines.append(("chat template prefills <think>", "yes" if self.think_prefilled else "no"))
        if self.complete:
            lines += [
                ("attention implementation", str(self.attn_implementation)),
                ("probe placement", f"{self.placement} ({self.placement_why})"),
                ("extra forwards per batch", "; ".join(self.extra_forwards) or "none"),
                ("dummy vision pass", f"{'on' if self.vision_pass else 'off'} ({self.vision_pass_why})"),
            ]
        else:
            waiting = f"decided once the weights load ({self.modules_why})"
            lines += [("attention implementation", waiting), ("probe placement", waiting),
                      ("extra forwards per batch", "; ".join(self.extra_forwards + ("where the probe measures: "
                                                                                   + waiting,))),
                      ("dummy vision pass", waiting)]
        width = max(len(k) for k, _ in lines)
        return "\n".join(["MDIGRPOTrainer run plan:"] + [f"  {k:<{width}}  {v}" for k, v in lines])


# ------------------------------------------------------------------------------------------------ the plan
def plan_run(model: Any, processing_class, reward_funcs: Any, args, columns: dict[str, list[str] | None], *,
             model_config=None) -> RunPlan:
    """The run plan, decided before any weight loads: the run's one pre-weight phase, which the entry point and
    ``MDIGRPOTrainer.__init__`` both call (the trainer only when not handed the entry point's plan).

    ``model``: an id, a path or a loaded model, as the trainer takes it. ``processing_class``: the processor the
    trainer will use (its chat template, its image token where the config names none). ``reward_funcs``: the
    trainer's argument (None, one reward or a list), which wins over ``args.reward_funcs`` (:class:`RewardsFrom`).
    ``args``: an :class:`~trl_mdi.MDIGRPOConfig` (a plain GRPOConfig upgraded first). ``columns``: split -> column
    names (None when unknown). ``model_config``: the model's config when the caller has read it (the entry point's
    model check); else it is read here as TRL will read it (``trust_remote_code`` from the config,
    ``model_init_kwargs`` first), so a model with custom code raises transformers' own error without it.
    """
    config = model_config if model_config is not None else load_model_config(
        model, args.model_init_kwargs, trust_remote_code=args.trust_remote_code)
    check_family(str(getattr(config, "model_type", "")))  # first: a refused family's other errors would mislead
    problem = image_token_problem(config, processing_class)
    if problem:
        raise ValueError(problem)
    facts = model_facts(config, processing_class)
    check_trainable(facts.model_type)  # before the run's settings: nothing else matters for a family TRL cannot train
    check_zero3_loading(model, facts.model_type, is_deepspeed_zero3_enabled())
    check_zero3_training(facts.model_type, is_deepspeed_zero3_enabled())
    setting_problem = processor_setting_problem(processing_class)
    if setting_problem:
        raise ValueError(setting_problem)
    check_vllm_prompts(args, processing_class, facts)  # before vLLM's engine starts
    prefilled = template_prefills_think(processing_class, args.chat_template_kwargs)
    if reward_funcs is not None and not isinstance(reward_funcs, (list, tuple)):
        reward_funcs = [reward_funcs]
    if reward_funcs:
        named, source = list(reward_funcs), RewardsFrom.ARGUMENT
    elif args.reward_funcs:
        named = list(args.reward_funcs)
        source = RewardsFrom.DEFAULT_STACK if named == list(DEFAULT_REWARDS) else RewardsFrom.CONFIG
    else:
        named, source = [], RewardsFrom.NONE
    if source is RewardsFrom.NONE:
        # GRPOTrainer's own behaviour: no reward source is its error; an environment's get_reward is its reward.
        names, weights, funcs = [], args.reward_weights, []
    else:
        names, weights = reward_stack_for_model(named, args.reward_weights, facts,
                                                default_stack=source is RewardsFrom.DEFAULT_STACK)
        funcs = resolve_reward_funcs(list(names), weights)
        # think_format pays for the format the prompt asks: bind this run's pattern and whether its template opens
        # <think> itself (a fresh instance per trainer, bound once).
        funcs = bind_think_format(funcs, answer_pattern=args.answer_pattern, think_prefilled=prefilled)
    user_named = source in (RewardsFrom.ARGUMENT, RewardsFrom.CONFIG)
    rewards = tuple(RewardInputs.of(f) for f in funcs)  # every reward's signature, inspected here once
    attention, why = attention_metrics(args, facts, rewards, user_named_rewards=user_named)
    segments = model_segments(args, facts, attention)
    try:
        check_reward_inputs(funcs, columns, attention=attention, segments=[n for n in segments if n != "all"],
                            reliance=facts.is_vlm)
        check_image_columns_for_perception(args, columns)
    except ValueError as e:  # the data cannot feed this plan: the data's error, said before any weight loads
        raise DatasetError(str(e)) from None
    counterfactual, counterfactual_why = counterfactual_plan(args, facts, rewards)
    plan = RunPlan(
        model_name=model if isinstance(model, str) else str(getattr(getattr(model, "config", None), "_name_or_path",
                                                                    type(model).__name__)),
        facts=facts,
        reward_funcs=tuple(funcs),
        reward_names=tuple(reward_name(f) for f in funcs),
        reward_weights=tuple(float(w) for w in weights) if weights is not None else None,
        rewards_from=source,
        attention_metrics=attention,
        attention_why=why,
        segment_layers=segments,
        token_layers=token_layers(args, facts, attention, counterfactual),
        attention_readers=tuple(attention_readers(args, rewards)) if attention else (),
        other_readers=tuple(other_readers(args, rewards)),
        attention_requests=tuple(attention_requests(args, rewards, user_named_rewards=user_named)),
        counterfactual=counterfactual,
        counterfactual_why=counterfactual_why,
        perturbed_forward=bool(args.uses_perturbed_forward),
        shared_counterfactual=counterfactual and args.shares_counterfactual_forward,
        think_prefilled=prefilled,
        trl_runs_policy_forward=trl_runs_policy_forward(args),
        num_processes=args.world_size,
    )
    try:
        skeleton = model_skeleton(model, config, args.model_init_kwargs, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a class that needs its weights to be built: those lines wait for them
        return dataclasses.replace(plan, modules_why=f"{type(e).__name__} building the model's class without "
                                                     f"weights: {' '.join(str(e).split())[:200]}")
    return plan.with_model(skeleton, processing_class)


def construction_problem(model, processing_class=None) -> str | None:
    """What ``MDIGRPOTrainer``'s construction says about ``model`` (a loaded model, with the default
    ``MDIGRPOConfig``), or None when it measures the model: the error :func:`plan_run` raises (a family refused by
    ``check_family``, a missing image token, ...), or why the plan turns attention metrics off (a text-only config,
    ``probe_support``'s reason). The family sweep (``python -m fixtures.sweep``) reads it per model type, so every
    refusal added to the plan shows in its table.
    """
    import tempfile

    from .config import MDIGRPOConfig

    with tempfile.TemporaryDirectory() as out:
        args = MDIGRPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none")
        try:
            plan = plan_run(model, processing_class, None, args, {})
        except ValueError as e:
            return str(e)
    return None if plan.attention_metrics else f"attention metrics off: {plan.attention_why}"


def load_processing_class(model: Any, args):
    """The processor ``GRPOTrainer.__init__`` would load when none is given, loaded the same way (TRL 1.16; the
    contract test pins the call), so that the plan can read its chat template before TRL is built."""
    from transformers import AutoProcessor
    from trl.trainer.utils import get_config_model_id

    if isinstance(model, str):
        model_id, revision = model, (args.model_init_kwargs or {}).get("revision")
    else:
        model_id, revision = get_config_model_id(model.config), None
    return AutoProcessor.from_pretrained(model_id, revision=revision, truncation_side="left", padding_side="left",
                                         trust_remote_code=args.trust_remote_code)


def effective_config(args, plan: RunPlan):
    """A copy of the (upgraded) config carrying the plan's values, for ``super().__init__``: the user's object stays
    as the user made it."""
    out = copy.copy(args)
    out.compute_attention_metrics = plan.attention_metrics
    out.reward_weights = list(plan.reward_weights) if plan.reward_weights is not None else None
    return out


def reward_stack_for_model(named: Sequence, weights: Sequence[float] | None, facts: ModelFacts, *,
                           default_stack: bool) -> tuple[list, list[float] | None]:
    """The rewards and weights a run uses (``default_reward_stack``: the default stack's names without weights get
    4 1 1), minus ``mdi_balance`` on a text-only model when they are the default stack (``default_stack``).

    Only the default stack is changed, with one warning: a text-only model has no MDI, and the 4:1:1 stack's
    balance term would be None for every rollout. Rewards the user named are never dropped.

    >>> from trl_mdi.attention.model_facts import ModelFacts
    >>> text = ModelFacts("qwen2", (), 2, (0, 1), None, None)
    >>> reward_stack_for_model(["mc_idx", "think_format", "mdi_balance"], None, text, default_stack=True)
    (['mc_idx', 'think_format'], [4.0, 1.0])
    """
    names, weights = default_reward_stack(named, weights)
    if default_stack and not facts.is_vlm and "mdi_balance" in names:
        logger.warning("MDIGRPOTrainer: %s is a text-only model (no image token): the default reward stack leaves "
                       "out mdi_balance", facts.model_type)
        keep = [i for i, n in enumerate(names) if n != "mdi_balance"]
        names = [names[i] for i in keep]
        weights = [weights[i] for i in keep] if weights is not None else None
    return names, weights


def attention_metrics(args, facts: ModelFacts, rewards: Sequence[RewardInputs], user_named_rewards: bool
                      ) -> tuple[bool, str]:
    """Whether attention metrics run on this model (``compute_attention_metrics``: None = auto), and why.

    A vision-language model: on unless set False. A text-only model: off, with one warning, unless something
    explicitly asks for attention, which is then an error naming the request: ``compute_attention_metrics=True``,
    a reward the user named that reads an ``mdi*`` / ``aei*`` field, perception filtering or trajectory
    reweighting (both measure how tokens depend on the image).
    """
    if facts.is_vlm:
        if args.compute_attention_metrics is False:
            if args.uses_attention_signal:
                raise ValueError(
                    "perception_signal='attention' (or perception_signal_compare) reads the attention probe, but "
                    "compute_attention_metrics=False turns it off. Leave compute_attention_metrics unset, or use "
                    "perception_signal='perturbation'."
                )
            return False, "compute_attention_metrics=False"
        return True, "a vision-language model" + (": compute_attention_metrics=True"
                                                  if args.compute_attention_metrics else "")
    requests = attention_requests(args, rewards, user_named_rewards)
    if requests:
        raise ValueError(
            f"the model ({facts.model_type}) is text-only: its config names no image token, so there is no image "
            f"attention to measure, but {'; '.join(requests)} need(s) it. Use a vision-language model, or drop "
            "those settings (compute_attention_metrics unset or False, rewards without mdi*/aei* inputs, perception "
            "filtering and trajectory reweighting off)."
        )
    if args.compute_attention_metrics is None:
        logger.warning("MDIGRPOTrainer: %s is a text-only model (no image token): attention metrics are off; the "
                       "trainer behaves as GRPOTrainer", facts.model_type)
    return False, "a text-only model: no image token"


def attention_requests(args, rewards: Sequence[RewardInputs], user_named_rewards: bool) -> list[str]:
    """What explicitly asks for attention: ``compute_attention_metrics=True``, a reward the user named that reads an
    ``mdi*`` / ``aei*`` field, perception filtering or trajectory reweighting (both measure how tokens depend on the
    image), the attention perception signal."""
    requests = []
    if args.compute_attention_metrics:
        requests.append("compute_attention_metrics=True")
    if user_named_rewards:
        requests += [f"reward {r.name!r} (reads {', '.join(r.attention_fields)})" for r in rewards
                     if r.attention_fields]
    for flag in ("enable_perception_filtering", "enable_trajectory_reweighting"):
        if getattr(args, flag):
            requests.append(f"{flag}=True")
    if args.perception_signal_compare:
        requests.append("perception_signal_compare=True")
    return requests


def model_segments(args, facts: ModelFacts, attention: bool) -> dict[str, tuple[int, ...]]:
    """The layer segments this model really has under ``args.attention_layer_segments`` (name -> measured layers,
    ``all`` included); {} with metrics off.

    Checks the spec against the model (ranges in its layer numbering, at least one softmax-attention layer per
    segment, at least one in the model) and logs which layers are measured and which a range skips.
    """
    if not attention:
        return {}
    spec = args.attention_layer_segments
    try:
        segments = M.layer_segments(facts.num_layers, spec, list(facts.measured_layers))
    except ValueError as e:
        raise ValueError(f"attention_layer_segments={spec!r} on this model ({facts.describe_layers()}): {e}") from None
    skipped = M.skipped_layers(facts.num_layers, spec, list(facts.measured_layers))
    logger.info("MDIGRPOTrainer: %s; segments: %s%s", facts.describe_layers(), describe_segments(segments),
                f"; skipped in ranges: {skipped}" if skipped else "")
    return {name: tuple(layers) for name, layers in segments.items()}


def token_layers(args, facts: ModelFacts, attention: bool, counterfactual: bool) -> tuple[int, ...]:
    """The measured layers of the probe's per-token image mass (``perception_attention_segment``, ``all`` where the
    model lacks it): used by the attention perception signal and by ``answer_image_attention``; () when unused."""
    if not facts.is_vlm or not (args.uses_attention_signal or (attention and counterfactual)):
        return ()
    return M.token_segment_layers(facts.num_layers, args.attention_layer_segments, list(facts.measured_layers),
                                  args.perception_attention_segment)


def counterfactual_plan(args, facts: ModelFacts, rewards: Sequence[RewardInputs]) -> tuple[bool, str]:
    """Whether the counterfactual forward runs, and why: ``reliance_signals=True``, or a reward reads a reliance
    field. They compare the image with a counterfactual, so a text-only model cannot have them."""
    readers = [f"reward {r.name} reads {', '.join(r.counterfactual_fields)}" for r in rewards if r.counterfactual_fields]
    why = "; ".join((["reliance_signals=True"] if args.reliance_signals else []) + readers)
    if why and not facts.is_vlm:
        raise ValueError(f"the model ({facts.model_type}) is text-only, but {why} compare(s) its answer with and "
                         "without the image: use a vision-language model, or drop those settings")
    return bool(why), why + (f"; counterfactual image: {args.counterfactual_image}" if why else "")


def other_readers(args, rewards: Sequence[RewardInputs]) -> list[str]:
    """What needs the policy forward of a batch before the loss besides attention: rewards reading reliance fields
    (they need the real image's log-probs) and TPRL (its filters and multipliers enter the loss)."""
    needs = [f"reward {r.name} reads {', '.join(r.policy_fields)}" for r in rewards if r.policy_fields]
    return needs + (["TPRL"] if args.uses_tprl else [])


def attention_readers(args, rewards: Sequence[RewardInputs]) -> list[str]:
    """What needs this batch's attention before the loss: rewards reading an ``mdi*`` / ``aei*`` field (online filtering
    included: it filters on rewards), and the perception-signal comparison. [] = metrics and logs only."""
    needs = [f"reward {r.name} reads {', '.join(r.attention_fields)}" for r in rewards if r.attention_fields]
    if args.perception_signal_compare:
        needs.append("perception_signal_compare")  # compares both perception signals before the loss
    return needs


def probe_placement(measured: bool, attention: bool, readers: Sequence[str], attn_implementation: str | None,
                    trl_runs_policy_forward: bool) -> tuple[ProbePlacement, str]:
    """Where the trainer reads the policy forward of a batch (the probe with attention metrics on, the real image's
    log-probs of the reliance signals, TPRL's inputs), and why (see :class:`ProbePlacement`): inside TRL's
    old-log-prob forward when TRL runs one; else in the training forward when nothing reads it before the loss and
    the model's attention kernel is one the probe runs beside unchanged; else one extra no-grad forward."""
    if not measured:
        return ProbePlacement.OFF, "nothing reads the policy forward"
    if trl_runs_policy_forward:
        return ProbePlacement.TRL_FORWARD, "TRL runs its own no-grad old-log-prob forward: no extra forward"
    if readers:
        return ProbePlacement.EXTRA_FORWARD, f"{'; '.join(readers)} before the loss"
    if attention and attn_implementation not in NATIVE_IMPLEMENTATIONS:
        return ProbePlacement.EXTRA_FORWARD, (
            f"the probe runs beside {' and '.join(NATIVE_IMPLEMENTATIONS)} attention only, and this model uses "
            f"{attn_implementation!r}: inside the training forward it would change the kernel of the loss")
    return ProbePlacement.TRAINING_FORWARD, ("nothing reads it before the loss, only metrics and logs: no "
                                             "extra forward; a batch's metrics and logs are written once its last "
                                             "slice has trained")


def check_image_columns_for_perception(args, splits: dict[str, list[str] | None]) -> None:
    """Perception filtering and trajectory reweighting measure how tokens depend on the image: data without an image
    column cannot feed them."""
    if not args.uses_perception_signal:
        return
    for split, cols in splits.items():
        if cols is not None and not {"image", "images"} & set(cols):
            raise ValueError(
                f"enable_perception_filtering / enable_trajectory_reweighting measure how much each token depends on "
                f"the image, but {split} has no 'image' or 'images' column (columns: {cols}). Turn them off for "
                "text-only data."
            )


# ------------------------------------------------------------------------------------------------ after loading
def check_filter_key(args, reward_names: Sequence[str]) -> None:
    """online_filtering's ``filter_key`` must name one of the rewards (or 'reward', the weighted total)."""
    if args.online_filtering:
        filter_column(args.filter_key, list(reward_names))


def check_world_size(num_processes: int, distributed: bool = True, world: int | None = None) -> None:
    """A multi-process launch that accelerate does not run as one: it sees fewer processes (every rank would train
    alone), or all of them but no distributed type (``distributed`` False: its gathers return this process's rows).
    ``world``: the launch's WORLD_SIZE, read before TRL's colocated vLLM overwrites it with what accelerate sees
    (default: the environment's)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    if world > 1 and (num_processes != world or not distributed):
        # Without a GPU accelerate finds no backend, reports one process per rank and every rank trains alone. Given
        # ddp_backend='gloo' but not use_cpu, it joins the processes in a gloo group yet reports DistributedType.NO,
        # so gather() is a no-op: TRL's advantages for rank 1 come out empty (an IndexError in shuffle_sequence_dict).
        seen = f"{num_processes} process(es)" + ("" if distributed else " with no distributed type (DistributedType.NO: "
                                                 "its gathers return this process's rows only)")
        raise RuntimeError(
            f"launched with WORLD_SIZE={world} but accelerate sees {seen}. On a machine without "
            "a GPU set ddp_backend='gloo' (and use_cpu=True for plain DDP; use_cpu=False with DeepSpeed); "
            "the entry point (examples/scripts/grpo_vlm.py in the repository, trl_mdi.cli.command.main) does this for you."
        )


def trl_runs_policy_forward(args) -> bool:
    """Whether TRL 1.16 runs a no-grad policy forward (old log-probs) per generation batch: its own condition, on the
    values it copies from the config (tests/test_trl_contract.py pins both)."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(
        args.use_vllm and args.vllm_importance_sampling_correction)


def vision_pass_plan(model, processing_class, num_processes: int, is_vlm: bool) -> tuple[bool, str]:
    """Whether image-less processes run the dummy vision pass (``trl_mdi.vision_pass``), and why: a vision-language
    model trained on several processes whose modules can take it (``vision_pass_problem``)."""
    if not is_vlm:
        return False, "a text-only model"
    if num_processes < 2:
        return False, "one process"
    problem = vision_pass_problem(model, processing_class)
    if problem:
        return False, (f"{problem}; under ZeRO-3 a batch with images on some processes only stops with an error "
                       "instead")
    return True, "image-less processes run the tower times zero"


def describe_segments(segments: dict[str, list[int]]) -> str:
    """'early 0-1 · middle 2 · late 3 · all 0-3' (runs of consecutive layers compressed).

    >>> describe_segments({"early": [0, 1], "late": [3, 7], "all": [0, 1, 3, 7]})
    'early 0-1 · late 3, 7 · all 0-1, 3, 7'
    """
    def runs(layers: list[int]) -> str:
        out, start = [], None
        for i, layer in enumerate(layers):
            if start is None:
                start = layer
            if i + 1 == len(layers) or layers[i + 1] != layer + 1:
                out.append(str(start) if start == layer else f"{start}-{layer}")
                start = None
        return ", ".join(out)

    return " · ".join(f"{name} {runs(layers)}" for name, layers in segments.items())
