"""Everything MDIGRPOTrainer decides at construction, in one frozen record printed at start: the run plan.

Two phases, because the facts arrive in two steps:

1. :func:`plan_run`, before any weight loads: from the model's config (``ModelFacts``), the arguments and the
   rewards: the reward stack and its weights, attention metrics on or off and why, the layer segments, the token
   layers of the attention perception signal, what reads attention before the loss. The entry point's
   ``--dry_run`` prints this phase with the same function, so what the dry run says is what the run does.
2. :meth:`RunPlan.with_model`, once ``GRPOTrainer.__init__`` has loaded the model and processor: the attention
   implementation, where the probe measures (:class:`ProbePlacement`), whether the chat template prefills
   ``<think>``, whether image-less processes run a dummy vision pass; and so the forwards the trainer adds.

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

from transformers.utils import logging

from .answer_format import template_prefills_think
from .attention import metrics as M
from .attention.model_facts import ModelFacts, image_token_problem, load_model_config, model_facts
from .attention.probe import NATIVE_IMPLEMENTATIONS
from .data.columns import DatasetError
from .filtering import filter_column
from .rewards import default_reward_stack, resolve_reward_funcs, reward_name
from .rewards.inputs import check_reward_inputs
from .signals import reads_attention, reads_counterfactual

logger = logging.get_logger(__name__)


class ProbePlacement(str, enum.Enum):
    """Where the attention probe measures each generation batch."""

    OFF = "off"  # attention metrics off
    TRL_FORWARD = "trl_forward"  # inside TRL's no-grad old-log-prob forward: no extra forward
    EXTRA_FORWARD = "extra_forward"  # one extra no-grad forward before the rewards
    TRAINING_FORWARD = "training_forward"  # inside the grad-enabled training forward, slice by slice: no extra forward

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
    """What a run does, decided once. Phase 1 fields come from :func:`plan_run`; phase 2 (``placement`` and the
    fields after it) from :meth:`with_model`, None until then."""

    model_name: str
    facts: ModelFacts
    reward_funcs: tuple  # what super().__init__ gets: callables (think_format bound to the answer pattern) and ids
    reward_names: tuple[str, ...]
    reward_weights: tuple[float, ...] | None
    rewards_from: str  # "yours", "MDIGRPOConfig.reward_funcs", "default stack", "none (TRL decides)"
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
    think_prefilled: bool | None = None  # the chat template opens <think> (None: no processor given to plan_run)
    # Phase 2: once the model is loaded.
    placement: ProbePlacement | None = None
    placement_why: str = ""
    attn_implementation: str | None = None
    trl_runs_policy_forward: bool | None = None
    vision_pass: bool | None = None

    @property
    def segments(self) -> tuple[str, ...]:
        """The per-segment names ("all" excluded): the suffixes of the ``mdi_<segment>`` fields."""
        return tuple(n for n in self.segment_layers if n != "all")

    @property
    def loaded(self) -> bool:
        return self.placement is not None

    def with_model(self, *, attn_implementation: str | None, trl_runs_policy_forward: bool, vision_pass: bool,
                   probe_unsupported: str | None = None) -> RunPlan:
        """Phase 2: the decisions that need the loaded model and processor. ``probe_unsupported``: why the probe
        cannot measure this model (``trl_mdi.attention.probe.probe_support``), None when it can."""
        plan = self
        if probe_unsupported and self.attention_metrics:
            plan = self.without_attention(probe_unsupported)
        placement, why = probe_placement(plan.measures_policy, plan.attention_metrics, plan.read_before_loss,
                                         attn_implementation, trl_runs_policy_forward)
        return dataclasses.replace(plan, placement=placement, placement_why=why,
                                   attn_implementation=attn_implementation,
                                   trl_runs_policy_forward=trl_runs_policy_forward, vision_pass=vision_pass)

    def without_attention(self, reason: str) -> RunPlan:
        """The plan with attention metrics off because the loaded model's attention cannot be measured: one warning
        that says why, as for a text-only model; an explicit request for attention is an error naming the reason.
        The default stack loses ``mdi_balance`` (it would score None on every rollout)."""
        requests = [r for r in self.attention_requests]
        if requests:
            raise ValueError(f"{reason}, but {'; '.join(requests)} need(s) its attention. Drop those settings (or use "
                             "a model whose attention runs through transformers' attention interface).")
        logger.warning("MDIGRPOTrainer: %s: attention metrics are off; the trainer behaves as GRPOTrainer", reason)
        names, weights = list(self.reward_names), self.reward_weights
        funcs = list(self.reward_funcs)
        if self.rewards_from == "the default stack" and "mdi_balance" in names:
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
        """The no-grad forwards the trainer adds per generation batch, each with its reason (phase 2 for the first)."""
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
        """The plan as printed at start (and by the entry point's ``--dry_run``, phase 1 only)."""
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
        if self.think_prefilled is not None:
            lines.append(("chat template prefills <think>", "yes" if self.think_prefilled else "no"))
        if self.loaded:
            lines += [
                ("attention implementation", str(self.attn_implementation)),
                ("probe placement", f"{self.placement} ({self.placement_why})"),
                ("extra forwards per batch", "; ".join(self.extra_forwards) or "none"),
                ("dummy vision pass", "on (image-less processes run the tower times zero)" if self.vision_pass
                 else "off"),
            ]
        elif self.extra_forwards:
            lines.append(("extra forwards per batch", "; ".join(self.extra_forwards) + " (and where the probe "
                          "measures, decided once the model is loaded)"))
        width = max(len(k) for k, _ in lines)
        phase = "" if self.loaded else " (before loading the model)"
        return "\n".join([f"MDIGRPOTrainer run plan{phase}:"] + [f"  {k:<{width}}  {v}" for k, v in lines])


# ------------------------------------------------------------------------------------------------ phase 1
def plan_run(model: Any, reward_funcs: Any, args, *, defaults_chosen: bool, columns: dict[str, list[str] | None],
             environment_rewards: bool = False, processing_class=None) -> RunPlan:
    """Phase 1 of the plan, before any weight loads.

    ``reward_funcs`` is what the caller passed (None, one reward or a list); ``defaults_chosen`` says whether the
    user chose this trainer's defaults (an ``MDIGRPOConfig``, or the entry point): only then does the 4:1:1 stack
    stand in for missing rewards. ``environment_rewards``: an ``environment_factory`` owns the reward
    (``get_reward``), so nothing stands in. ``columns``: split -> column names (None when unknown).
    ``processing_class``: the processor, when the caller has it (it knows the image token of a custom VLM whose
    config names none).

    The model's config is read as TRL will read it (``trust_remote_code`` from the config, ``model_init_kwargs``
    first), so a model with custom code raises transformers' own error without it and loads with it.
    """
    config = load_model_config(model, args.model_init_kwargs, trust_remote_code=args.trust_remote_code)
    problem = image_token_problem(config, processing_class)
    if problem:
        raise ValueError(problem)
    facts = model_facts(config, processing_class)
    prefilled = (template_prefills_think(processing_class, args.chat_template_kwargs)
                 if processing_class is not None else None)
    if reward_funcs is not None and not isinstance(reward_funcs, (list, tuple)):
        reward_funcs = [reward_funcs]
    named = list(reward_funcs) if reward_funcs else (list(args.reward_funcs) if args.reward_funcs else None)
    source = "yours" if reward_funcs else "MDIGRPOConfig.reward_funcs" if named else None
    if named is None and (not defaults_chosen or environment_rewards):
        # GRPOTrainer's own behaviour: no reward source is its error; an environment's get_reward is its reward.
        names, weights, funcs, source = [], args.reward_weights, [], "none given (GRPOTrainer decides)"
    else:
        names, weights = reward_stack_for_model(named, args.reward_weights, facts)
        source = source or "the default stack"
        funcs = resolve_reward_funcs(list(names), weights)
        from .rewards import bind_think_format

        # think_format pays for the format the prompt asks: bind this run's pattern and, when the processor is known,
        # whether its template opens <think> itself (a fresh instance per trainer, bound once).
        funcs = bind_think_format(funcs, answer_pattern=args.answer_pattern,
                                  **({"think_prefilled": prefilled} if prefilled is not None else {}))
    rewards = tuple(RewardInputs.of(f) for f in funcs)  # every reward's signature, inspected here once
    attention, why = attention_metrics(args, facts, rewards, user_named_rewards=named is not None)
    segments = model_segments(args, facts, attention)
    try:
        check_reward_inputs(funcs, columns, attention=attention, segments=[n for n in segments if n != "all"],
                            reliance=facts.is_vlm)
        check_image_columns_for_perception(args, columns)
    except ValueError as e:  # the data cannot feed this plan: the data's error, said before any weight loads
        raise DatasetError(str(e)) from None
    counterfactual, counterfactual_why = counterfactual_plan(args, facts, rewards)
    return RunPlan(
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
        attention_requests=tuple(attention_requests(args, rewards, user_named_rewards=named is not None)),
        counterfactual=counterfactual,
        counterfactual_why=counterfactual_why,
        perturbed_forward=bool(args.uses_perturbed_forward),
        shared_counterfactual=counterfactual and args.shares_counterfactual_forward,
        think_prefilled=prefilled,
    )


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


def reward_stack_for_model(named: Sequence | None, weights: Sequence[float] | None,
                           facts: ModelFacts) -> tuple[list, list[float] | None]:
    """The rewards and weights a run uses (``default_reward_stack``), minus ``mdi_balance`` on a text-only model.

    Only the default stack is changed, with one warning: a text-only model has no MDI, and the 4:1:1 stack's
    balance term would be None for every rollout. Rewards the user named are never dropped.

    >>> from trl_mdi.attention.model_facts import ModelFacts
    >>> text = ModelFacts("qwen2", (), 2, (0, 1), None, None)
    >>> reward_stack_for_model(None, None, text)
    (['mc_idx', 'think_format'], [4.0, 1.0])
    """
    names, weights = default_reward_stack(named, weights)
    if named is None and not facts.is_vlm and "mdi_balance" in names:
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


def trl_runs_policy_forward(args, num_iterations: int, use_vllm: bool, vllm_importance_sampling: bool) -> bool:
    """Whether TRL 1.16 runs a no-grad policy forward (old log-probs) per generation batch (its own condition;
    tests/test_trl_contract.py pins it)."""
    generate_every = args.steps_per_generation * num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or bool(use_vllm and vllm_importance_sampling)


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
