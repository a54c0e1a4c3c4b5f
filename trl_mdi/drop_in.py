"""What MDIGRPOTrainer decides at construction from the model and the config, before any weight is loaded.

Each function reads explicit inputs (the config, the model's :class:`~trl_mdi.attention.model_facts.ModelFacts`,
the reward functions) and either returns a decision or raises one clear error, so that a TRL script that works
with ``GRPOTrainer`` works unchanged and only a request that cannot be met stops the run.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

from transformers.utils import logging

from .attention import metrics as M
from .attention.model_facts import ModelFacts
from .attention.probe import NATIVE_IMPLEMENTATIONS
from .rewards import default_reward_stack, required_reward_inputs, reward_name
from .signals import reward_field_pattern

logger = logging.get_logger(__name__)


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


def resolve_attention_metrics(args, facts: ModelFacts, funcs: Sequence, user_named_rewards: bool) -> bool:
    """Decide ``args.compute_attention_metrics`` (None = auto) for this model; write it back and return it.

    A vision-language model: on unless set False. A text-only model: off, with one warning, unless something
    explicitly asks for attention, which is then an error naming the request: ``compute_attention_metrics=True``,
    a reward the user named that reads an ``mdi*`` / ``aei*`` field, perception filtering or trajectory
    reweighting (both measure how tokens depend on the image).
    """
    if facts.is_vlm:
        if args.compute_attention_metrics is False and args.uses_token_attention:
            raise ValueError(
                "perception_signal='attention' (or perception_signal_compare) reads the attention probe, but "
                "compute_attention_metrics=False turns it off. Leave compute_attention_metrics unset, or use "
                "perception_signal='perturbation'."
            )
        args.compute_attention_metrics = args.compute_attention_metrics is not False
        return args.compute_attention_metrics
    requests = []
    if args.compute_attention_metrics:
        requests.append("compute_attention_metrics=True")
    if user_named_rewards:
        for f in funcs:
            fields = [n for n in required_reward_inputs(f) if reward_field_pattern(n)] if callable(f) else []
            if fields:
                requests.append(f"reward {reward_name(f)!r} (reads {', '.join(fields)})")
    for flag in ("enable_perception_filtering", "enable_trajectory_reweighting"):
        if getattr(args, flag):
            requests.append(f"{flag}=True")
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
    args.compute_attention_metrics = False
    return False


def model_segment_names(args, facts: ModelFacts) -> list[str]:
    """The layer segments this model really has under ``args.attention_layer_segments``; [] with metrics off.

    Checks the spec against the model (ranges in its layer numbering, at least one softmax-attention layer per
    segment, at least one in the model) and logs which layers are measured and which a range skips.
    """
    if not args.compute_attention_metrics:
        return []
    spec = args.attention_layer_segments
    try:
        segments = M.layer_segments(facts.num_layers, spec, list(facts.measured_layers))
    except ValueError as e:
        raise ValueError(f"attention_layer_segments={spec!r} on this model ({facts.describe_layers()}): {e}") from None
    skipped = M.skipped_layers(facts.num_layers, spec, list(facts.measured_layers))
    logger.info("MDIGRPOTrainer: %s; segments: %s%s", facts.describe_layers(), describe_segments(segments),
                f"; skipped in ranges: {skipped}" if skipped else "")
    return [n for n in segments if n != "all"]


def perception_token_layers(args, facts: ModelFacts) -> tuple[int, ...]:
    """The measured layers the attention perception signal averages over; () when it is not used.

    ``args.perception_attention_segment`` of ``args.attention_layer_segments`` on this model; a model without that
    segment (thirds of 1 or 2 measured layers, an explicit spec without it) falls back to ``all``, said in one line.
    """
    if not args.uses_token_attention:
        return ()
    segments = M.layer_segments(facts.num_layers, args.attention_layer_segments, list(facts.measured_layers))
    name = args.perception_attention_segment
    if name not in segments:
        logger.warning("MDIGRPOTrainer: perception_signal='attention' averages over segment %r, which this model does "
                       "not have (segments: %s): using all measured layers (%s) instead", name,
                       ", ".join(segments), describe_segments({"all": segments["all"]}))
        name = "all"
    return tuple(segments[name])


def attention_consumers(args, funcs: Sequence) -> list[str]:
    """What needs this batch's attention before the loss: rewards reading an ``mdi*`` / ``aei*`` field (online filtering
    included: it filters on rewards), and TPRL (its filters and multipliers enter the loss). [] = metrics only."""
    needs = []
    for f in funcs:
        # Every named parameter, optional ones included (``mdi=None``): a reward reads the signals it names.
        fields = [n for n in inspect.signature(f).parameters if reward_field_pattern(n)] if callable(f) else []
        if fields:
            needs.append(f"reward {reward_name(f)} reads {', '.join(fields)}")
    if args.uses_tprl:
        needs.append("TPRL")
    if args.perception_signal_compare:
        needs.append("perception_signal_compare")  # compares a_t with s_t from the perturbed forward, before the loss
    return needs


def probe_placement(args, funcs: Sequence, attn_implementation: str | None, trl_runs_policy_forward: bool) -> str:
    """Where the attention probe measures each generation batch, said in one log line at start:

    - ``"off"``: attention metrics off;
    - ``"trl_forward"``: inside TRL's no-grad old-log-prob forward (TRL runs one: no extra forward);
    - ``"extra_forward"``: one extra no-grad forward before the rewards (a consumer needs the attention first, or the
      model's attention implementation is one the probe cannot run beside unchanged);
    - ``"training_forward"``: inside the grad-enabled training forward, each slice of the batch at its first pass
      (metrics and logs only: zero extra forwards; written once the batch's last slice is measured).
    """
    if not args.compute_attention_metrics:
        return "off"
    if trl_runs_policy_forward:
        logger.info("MDIGRPOTrainer: attention measured inside TRL's old-log-prob forward (no extra forward)")
        return "trl_forward"
    needs = attention_consumers(args, funcs)
    if needs:
        why = f"{'; '.join(needs)} before the loss"
    elif attn_implementation not in NATIVE_IMPLEMENTATIONS:
        why = (f"the probe runs beside {' and '.join(NATIVE_IMPLEMENTATIONS)} attention only, and this model uses "
               f"{attn_implementation!r}: inside the training forward it would change the kernel of the loss")
    else:
        logger.info("MDIGRPOTrainer: attention measured inside TRL's training forward (nothing reads it before the "
                    "loss: metrics and logs only): no extra forward; a batch's metrics and logs are written once its "
                    "last slice has trained")
        return "training_forward"
    logger.info("MDIGRPOTrainer: attention measured in one extra no-grad forward per generation batch (%s)", why)
    return "extra_forward"


def check_image_columns_for_tprl(args, splits: dict[str, list[str] | None]) -> None:
    """Perception filtering and trajectory reweighting measure how tokens depend on the image: data without an image
    column cannot feed them."""
    if not args.uses_visual_dependency:
        return
    for split, cols in splits.items():
        if cols is not None and not {"image", "images"} & set(cols):
            raise ValueError(
                f"enable_perception_filtering / enable_trajectory_reweighting measure how much each token depends on "
                f"the image, but {split} has no 'image' or 'images' column (columns: {cols}). Turn them off for "
                "text-only data."
            )


def check_filter_key(args, reward_names: list[str]) -> None:
    """online_filtering's ``filter_key`` must name one of the rewards (or 'reward', the weighted total)."""
    if args.online_filtering and args.filter_key != "reward":
        if not any(n in (args.filter_key, f"{args.filter_key}_reward") for n in reward_names):
            raise ValueError(f"filter_key {args.filter_key!r} is not one of the rewards {reward_names} (or 'reward' "
                             "for the weighted total)")


def check_world_size(num_processes: int) -> None:
    """A multi-process launch in which accelerate sees fewer processes: every rank would train alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and num_processes != world:
        # Without a GPU accelerate finds no backend, reports one process per rank and every rank trains alone.
        raise RuntimeError(
            f"launched with WORLD_SIZE={world} but accelerate sees {num_processes} process(es). On a machine without "
            "a GPU set ddp_backend='gloo' (and use_cpu=True for plain DDP; use_cpu=False with DeepSpeed); "
            "examples/scripts/grpo_vlm.py does this for you."
        )


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


__all__ = ["check_filter_key", "check_image_columns_for_tprl", "check_world_size", "describe_segments",
           "model_segment_names", "resolve_attention_metrics", "reward_stack_for_model"]
