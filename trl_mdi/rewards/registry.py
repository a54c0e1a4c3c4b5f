"""The reward registry, its defaults, and resolving / checking / describing reward functions."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ..signals import trainer_field
from .functions import (
    accuracy,
    answer_visual_gain,
    answer_visual_gain_group,
    guarded_visual_gain,
    mc_idx,
    mdi_balance,
    mdi_group,
    think_format,
    think_format_lenient,
    visual_gain,
    visual_gain_sum,
)

__all__ = [
    "DEFAULT_REWARDS",
    "DEFAULT_REWARD_WEIGHTS",
    "REQUIRED_COLUMNS",
    "REWARD_REGISTRY",
    "TRL_PROVIDED",
    "default_reward_stack",
    "required_reward_inputs",
    "resolve_reward_funcs",
    "resolve_rewards",
    "reward_help",
    "reward_name",
]

# Keyword arguments GRPOTrainer passes to every reward itself; they are never dataset columns.
TRL_PROVIDED = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)



# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------

REWARD_REGISTRY: dict[str, Callable[..., list[float | None]]] = {
    "mc_idx": mc_idx,
    # The default: the format the system prompt asks (trl_mdi.answer_format); the trainer binds its pattern.
    "think_format": think_format,
    # Any non-empty text after </think>: pays for junk like 'Answer" A' (kept for free-form answers).
    "think_format_lenient": think_format_lenient,
    "mdi_balance": mdi_balance,
    "mdi_group": mdi_group,
    "accuracy": accuracy,
    # Reliance (docs/reliance.md): the answer's log-prob gain from the image over the counterfactual.
    "answer_visual_gain": answer_visual_gain,
    "answer_visual_gain_group": answer_visual_gain_group,
    # ...and the completion's: where a chain of thought takes the image in (mean and sum forms).
    "visual_gain": visual_gain,
    "visual_gain_sum": visual_gain_sum,
    # The guarded form (docs/rewards.md): right and well-formed rollouts only, the largest token gain, flat steps.
    "guarded_visual_gain": guarded_visual_gain,
}
DEFAULT_REWARDS: tuple[str, ...] = ("mc_idx", "think_format", "mdi_balance")
DEFAULT_REWARD_WEIGHTS: tuple[float, ...] = (4.0, 1.0, 1.0)

# Dataset column each registry reward reads (tests check these agree with the signatures).
REQUIRED_COLUMNS: dict[str, str] = {"mc_idx": "label_idx", "accuracy": "solution", "guarded_visual_gain": "label_idx"}


def required_reward_inputs(reward_func: Callable) -> tuple[str, ...]:
    """Named inputs a reward needs: its parameters without defaults, minus what TRL always passes.

    Each is either a per-rollout signal the trainer provides (``trl_mdi.signals``) or a dataset column.

    >>> required_reward_inputs(mc_idx), required_reward_inputs(mdi_balance)
    (('label_idx',), ('mdi_balance',))
    """
    params = inspect.signature(reward_func).parameters.values()
    return tuple(
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in TRL_PROVIDED
    )


def _import_reward(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"bad reward import path {path!r}: expected 'pkg.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as e:  # a module may fail at import with any error; report it, keep the chain
        raise ValueError(f"cannot load reward {path!r}: {type(e).__name__}: {e}") from e
    if inspect.isclass(target):
        raise TypeError(f"reward {path!r} is a class; point to an instance of it (or to a function)")
    if not callable(target):
        raise TypeError(f"reward {path!r} is a {type(target).__name__}, not a callable")
    if not isinstance(getattr(target, "__name__", None), str):
        raise TypeError(f"reward {path!r} has no __name__ (TRL names its metrics rewards/<__name__>/...)")
    return target


def resolve_rewards(
    names: Sequence[str], weights: Sequence[float] | None = None
) -> tuple[list[Callable], list[float]]:
    """Reward callables and weights for registry names or import paths ``"pkg.module:function"``.

    ``weights=None`` gives 1.0 each (TRL's convention; the config's default is
    ``DEFAULT_REWARD_WEIGHTS``). Raises ValueError for an unknown name (listing the registry), a
    weight count that differs from the reward count, an import path that fails to load (with the
    original error), two rewards with the same ``__name__`` (their metrics would collide) and an
    empty list; TypeError for a target that is not a named callable.

    >>> fns, w = resolve_rewards(["mc_idx", "mdi_balance"], [4.0, 1.0])
    >>> [f.__name__ for f in fns], w
    (['mc_idx', 'mdi_balance'], [4.0, 1.0])
    """
    if not names:
        raise ValueError(f"no reward functions given; the default is {list(DEFAULT_REWARDS)}")
    funcs = []
    for name in names:
        name = name.strip()
        if name in REWARD_REGISTRY:
            funcs.append(REWARD_REGISTRY[name])
        elif ":" in name:
            funcs.append(_import_reward(name))
        else:
            raise ValueError(
                f"unknown reward {name!r}. Registry names: {', '.join(REWARD_REGISTRY)}. "
                f"For your own reward give its import path 'pkg.module:function', a callable "
                f"fn(completions, <dataset columns>, **kwargs) -> list[float | None]."
            )
    seen: dict[str, str] = {}
    for name, fn in zip(names, funcs):
        if fn.__name__ in seen:
            raise ValueError(f"rewards {seen[fn.__name__]!r} and {name!r} share the name {fn.__name__!r}")
        seen[fn.__name__] = name
    if weights is None:
        return funcs, [1.0] * len(funcs)
    check_weight_count(names, weights)
    return funcs, [float(w) for w in weights]


def check_weight_count(names: Sequence, weights: Sequence[float] | None) -> None:
    """One weight per reward, or none at all (equal weights)."""
    if weights is not None and len(weights) != len(names):
        raise ValueError(f"{len(weights)} reward weights for {len(names)} reward functions "
                         f"({', '.join(map(reward_name, names))}): give one weight per reward")


def default_reward_stack(names: Sequence | None, weights: Sequence[float] | None) -> tuple[list, list[float] | None]:
    """The rewards and weights a run uses: the given ones, else the 4:1:1 stack.

    The default weights apply only when the names are the default stack and no weights were given, so a user's
    ``reward_weights`` is never replaced.

    >>> default_reward_stack(None, None)
    (['mc_idx', 'think_format', 'mdi_balance'], [4.0, 1.0, 1.0])
    >>> default_reward_stack(["mc_idx"], None)
    (['mc_idx'], None)
    """
    names = list(names) if names else list(DEFAULT_REWARDS)
    if weights is None and names == list(DEFAULT_REWARDS):
        return names, list(DEFAULT_REWARD_WEIGHTS)
    return names, (list(weights) if weights is not None else None)


def _first_doc_line(fn: Callable) -> str:
    doc = inspect.getdoc(fn) or ""
    return next((line.strip() for line in doc.splitlines() if line.strip()), "(no description)")


def reward_help() -> str:
    """CLI help for the reward options, generated from ``REWARD_REGISTRY`` so it cannot drift.

    >>> print(reward_help().splitlines()[1])
      mc_idx                    Multiple-choice accuracy: 1.0 when the parsed answer letter is the label's, else 0.0. [dataset column: label_idx]
    """
    width = max(len(name) for name in REWARD_REGISTRY) + 2
    lines = [
        f"Reward functions by registry name (default: {' '.join(DEFAULT_REWARDS)}, "
        f"weights {' '.join(str(w) for w in DEFAULT_REWARD_WEIGHTS)}):"
    ]
    for name, fn in REWARD_REGISTRY.items():
        needs = required_reward_inputs(fn)
        columns = [n for n in needs if not trainer_field(n)]
        fields = [n for n in needs if trainer_field(n)]
        notes = ([f"dataset column: {', '.join(columns)}"] if columns else []) + (
            [f"computed by the trainer: {', '.join(fields)}"] if fields else []
        )
        suffix = f" [{'; '.join(notes)}]" if notes else ""
        lines.append(f"  {name:<{width}}{_first_doc_line(fn)}{suffix}")
    lines.append(
        "Or your own reward by import path 'pkg.module:function': "
        "fn(completions, <dataset columns>, **kwargs) -> list[float | None]."
    )
    return "\n".join(lines)


def resolve_reward_funcs(names: list, weights: list[float] | None) -> list:
    """Registry names and 'pkg.module:function' paths -> functions, for a trainer's ``reward_funcs``.

    Callables and strings that look like Hub model ids (``org/name``, which TRL loads as reward models itself)
    pass through unchanged.
    """
    check_weight_count(names, weights)
    out = []
    for r in names:
        if isinstance(r, str) and (r in REWARD_REGISTRY or ":" in r or "/" not in r):
            out.extend(resolve_rewards([r], None)[0])
        else:
            out.append(r)
    return out


def reward_name(r) -> str:
    """The name TRL logs a reward under (``rewards/<name>/mean``)."""
    return r if isinstance(r, str) else getattr(r, "__name__", type(r).__name__)
