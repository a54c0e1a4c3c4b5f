"""Every ```python block of README.md and docs/*.md runs here, or has every name it imports and reads checked.

``BLOCKS`` gives each block its mode; a block that no entry matches (a new one, or one whose marker was edited away)
fails ``test_every_python_block_has_a_mode``, and so does an entry that matches no block. Modes:

* ``run``: the block is executed offline. Only the values a CPU cannot use are swapped (``swaps``: a Hub id for a
  tiny local model built by ``fixtures.tiny``, a data path for synthetic data, GPU and scale settings for one CPU
  step); names the surrounding prose gives it (``result = measure_modality_attention(model, ...)``) are bound to real
  objects by ``setup``; ``check`` then asserts what the prose promises (the trainer stepped, the row holds the
  trainer's values, the reward's inputs are fields the trainer provides, ...).
* ``static``: for a block that cannot run here (a GPU, vLLM, the Hub, several processes); give the reason in
  ``why``. It gets the static check below and nothing else.

Every block, run ones included, first gets the static check (``static_problems``): the block is parsed with ``ast``;
each imported module is imported and each imported name looked up; every name it reads is imported, bound in the
block, a builtin, or declared in ``context`` (what the prose around it defines); and every attribute it reads on an
object the check can type (a module, a class, a name from ``context``, the result of a call whose return annotation
is a class, e.g. ``res = measure_modality_attention(...)`` -> ``ModalityAttention``) exists.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from test_readme import ROOT, doc_files, fenced_blocks

from trl_mdi import signals as S
from trl_mdi.attention import ModalityAttention, measure_modality_attention

HUB_MODEL = '"Qwen/Qwen2.5-VL-3B-Instruct"'
RUN, STATIC = "run", "static"


# ------------------------------------------------------------------------------------------------ the blocks
@dataclass(frozen=True)
class Found:
    page: str  # README.md, docs/<page>.md
    line: int  # of the opening fence
    code: str  # dedented

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks() -> list[Found]:
    """Every ```python block of README.md and docs/*.md, in page order."""
    return [Found(str(path.relative_to(ROOT)), line, body) for path in doc_files()
            for _, body, line in fenced_blocks(path.read_text(encoding="utf-8"), "python")]


@dataclass(frozen=True)
class Instance:
    """An object of class ``cls`` the static check knows the type of but not the value."""

    cls: type


@dataclass(frozen=True)
class DocBlock:
    name: str  # the test id
    page: str
    marker: str  # a string only this python block of the page holds: how the block is found
    mode: str  # RUN or STATIC
    why: str = ""  # STATIC: why it cannot run here
    context: dict[str, object] = field(default_factory=dict)  # for the static check: name -> object or Instance(cls)
    template: str = "{code}"  # RUN: what is executed, e.g. a fragment placed into the construct it belongs to
    setup: Callable[[pytest.FixtureRequest], tuple[dict[str, str], dict[str, object]]] | None = None  # -> swaps, names
    check: Callable[[dict, pytest.FixtureRequest], None] | None = None  # RUN: asserts on the block's namespace


def matches(entry: DocBlock, block: Found) -> bool:
    return entry.page == block.page and entry.marker in block.code


def block_of(entry: DocBlock) -> Found:
    found = [b for b in python_blocks() if matches(entry, b)]
    assert len(found) == 1, f"{entry.name} matches {len(found)} python blocks: {[b.where for b in found]}"
    return found[0]


# ------------------------------------------------------------------------------------------------ setups, checks
def _tiny_result(request) -> ModalityAttention:
    """A probe result of the tiny Qwen2.5-VL on two rows: one with an image, one text-only."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from fixtures.testing import grpo_batch, shape_image

    path = request.getfixturevalue("tiny_vlm_dir")("qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    batch = grpo_batch(AutoProcessor.from_pretrained(path), ["What colour is the shape?", "How many shapes?"],
                       [shape_image(56, 1), None], [5, 3])
    return measure_modality_attention(model, **batch)


def _readme_setup(request):
    tmp = request.getfixturevalue("tmp_path")
    return {
        HUB_MODEL: repr(str(request.getfixturevalue("tiny_vlm_dir")("qwen2_5_vl"))),
        '"./aokvqa_trl_data_simple/train.parquet"': repr(str(request.getfixturevalue("prepared_aokvqa_dir")
                                                             / "train.parquet")),
        '"qwen2.5-vl-3b-mdi-grpo"': repr(str(tmp / "out")),
        "bf16=True": "bf16=False, use_cpu=True",
        "max_steps=500": "max_steps=1, logging_steps=1",
        "max_completion_length=256": "max_completion_length=8",
        'report_to="trackio"': 'report_to="none"',
    }, {}


def _readme_check(ns, request):
    trainer = ns["trainer"]
    assert trainer.state.global_step == 1
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and "attention/mdi_late" in logs[0] and "rewards/mdi_balance/mean" in logs[0]


def _probe_setup(request):
    return {HUB_MODEL: repr(str(request.getfixturevalue("tiny_vlm_dir")("qwen2_5_vl")))}, {}


def _probe_check(ns, request):
    res, row = ns["res"], ns["row"]
    assert isinstance(res, ModalityAttention) and res.valid.all() and res.has_image.all()
    # The row is what the trainer hands a reward for this rollout (mdi_group_score aside: it needs the group).
    trainer_row = S.rollout_rows(S.rollout_signals(res, "thirds", 2.0))[0]
    fields = [n for n in S.field_names(["early", "middle", "late"], reward=True) if n != "mdi_group_score"]
    assert list(row) == fields
    assert row == {n: trainer_row[n] for n in fields}
    assert all(isinstance(v, float) for v in row.values())


def _profile_setup(request):
    return {}, {"result": _tiny_result(request)}


def _profile_check(ns, request):
    for name in ("mdi_by_layer.png", "by_hand.png", "mass_by_layer.png"):
        assert (request.getfixturevalue("tmp_path") / name).stat().st_size > 0, name


def _reward_check(ns, request):
    """The prose: saved as my_rewards.py on PYTHONPATH, selected as ``my_rewards:late_vision_reward`` next to registry
    names; its inputs are fields the trainer provides."""
    from trl_mdi.rewards.inputs import check_reward_inputs
    from trl_mdi.rewards.registry import resolve_rewards

    tmp = request.getfixturevalue("tmp_path")
    (tmp / "my_rewards.py").write_text(block_of(BLOCKS_BY_MARKER["late_vision_reward"]).code, encoding="utf-8")
    request.getfixturevalue("monkeypatch").syspath_prepend(str(tmp))
    try:
        funcs, weights = resolve_rewards(["mc_idx", "think_format", "my_rewards:late_vision_reward"], [4, 1, 1])
    finally:
        sys.modules.pop("my_rewards", None)
    assert weights == [4.0, 1.0, 1.0]
    check_reward_inputs(funcs, {"train": ["prompt", "image", "label_idx"]}, attention=True,
                        segments=["early", "middle", "late"])
    assert funcs[2](["a", "b"], mdi_late=[1.0, None]) == [0.5, None]


def _hand_made_result() -> ModalityAttention:
    b, layers = 2, 6
    image = torch.linspace(0.05, 0.3, b * layers).reshape(b, layers)
    return ModalityAttention(
        image=image, prompt_text=0.6 - image, completion=torch.full((b, layers), 0.3),
        special=torch.full((b, layers), 0.1), n_image=torch.tensor([4, 0]), n_prompt_text=torch.tensor([10, 12]),
        n_special=torch.tensor([2, 2]), n_completion=torch.tensor([3, 3]), n_queries=torch.tensor([3, 3]),
    )


def _worked_signal() -> tuple[S.Signal, ...]:
    """The worked example of docs/signals.md: the table entries its first block adds."""
    entry = BLOCKS_BY_MARKER['Signal("image_mass_{segment}"']
    ns = dict(vars(S))
    exec(compile(entry.template.format(code=block_of(entry).code), entry.page, "exec"), ns)  # noqa: S102
    return ns["NEW_SIGNALS"]


def _signal_entry_check(ns, request):
    (signal,) = ns["NEW_SIGNALS"]
    assert isinstance(signal, S.Signal) and signal.reward and signal.metric
    request.getfixturevalue("monkeypatch").setattr(S, "SIGNALS", (*S.SIGNALS, signal))
    att = _hand_made_result()
    values = S.rollout_signals(att, "thirds", 2.0)
    for segment, metrics in att.segment_metrics("thirds").items():
        if segment != "all":
            torch.testing.assert_close(values[f"image_mass_{segment}"], metrics["image_mass"])
    assert "image_mass_late" in S.field_names(["early", "late"], reward=True)
    assert "attention/image_mass_<segment>" in dict(S.glossary())


def _signal_reward_check(ns, request):
    from trl_mdi.rewards.inputs import check_reward_inputs

    reward = ns["late_look_reward"]
    segments = ["early", "middle", "late"]
    with pytest.raises(ValueError, match="image_mass_late"):  # without the worked example's table entry
        check_reward_inputs([reward], {"train": ["prompt", "image"]}, attention=True, segments=segments)
    request.getfixturevalue("monkeypatch").setattr(S, "SIGNALS", (*S.SIGNALS, *_worked_signal()))
    check_reward_inputs([reward], {"train": ["prompt", "image"]}, attention=True, segments=segments)
    assert reward(["a", "b"], image_mass_late=[0.25, None]) == [2.5, None]


def _counterfactual_entry_check(ns, request):
    """docs/signals.md's counterfactual example: on a hand-made record, the share of valid tokens with g_t > 0 (NaN
    for a row with none), and a field of the counterfactual forward with its rollout-log column and glossary row."""
    from trl_mdi.answer_tokens import AnswerTokens

    (signal,) = ns["NEW_SIGNALS"]
    assert isinstance(signal, S.Signal) and signal.source == S.COUNTERFACTUAL and signal.reward and signal.metric
    request.getfixturevalue("monkeypatch").setattr(S, "SIGNALS", (*S.SIGNALS, signal))
    logps = torch.tensor([[-1.0, -2.0, -0.5, 9.0], [-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    cf = torch.tensor([[-1.5, -1.0, -2.5, 0.0], [-2.0, -2.0, -2.0, -2.0], [-2.0, -2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    none = torch.full((3,), -1)
    answers = AnswerTokens(span_mask=torch.zeros(3, 4, dtype=torch.bool), letter_position=none, answer_index=none,
                           candidates=torch.full((3, 1), -1), n_choices=torch.zeros(3, dtype=torch.long))
    record = S.CounterfactualInputs.of(S.PolicyForward(logps=logps), S.CounterfactualForward(cf, None, answers), mask,
                                       torch.tensor([True, False, True]))
    values = S.counterfactual_signals(record)  # gains 0.5, -1, 2 (padding excluded); no image; no token
    torch.testing.assert_close(values[signal.name], torch.tensor([2 / 3, math.nan, math.nan]), equal_nan=True)
    assert S.reads_counterfactual(signal.name) and (signal.name, "gain share") in S.rollout_log_columns()
    assert "reliance/gain_token_share" in dict(S.glossary())


def _counterfactual_reward_check(ns, request):
    from trl_mdi.rewards.inputs import check_reward_inputs

    reward = ns["gain_share_reward"]
    with pytest.raises(ValueError, match="gain_token_share"):  # without the worked example's table entry
        check_reward_inputs([reward], {"train": ["prompt", "image"]}, attention=False, reliance=True)
    entry = BLOCKS_BY_MARKER['Signal("gain_token_share"']
    table = dict(vars(S))
    exec(compile(entry.template.format(code=block_of(entry).code), entry.page, "exec"), table)  # noqa: S102
    request.getfixturevalue("monkeypatch").setattr(S, "SIGNALS", (*S.SIGNALS, *table["NEW_SIGNALS"]))
    check_reward_inputs([reward], {"train": ["prompt", "image"]}, attention=False, reliance=True)
    assert reward(["a", "b"], gain_token_share=[0.75, None]) == [0.25, None]


def _reliance_statistics_check(ns, request):
    """The prose: the within-prompt AUROC of a signal that is lower on wording-following rollouts, and Holm over two
    paired effects. By hand: prompt p1's two positives (0.1, 0.0) lie below both negatives (4 of 4 pairs), prompt
    p2's 0.05 below 0.4 and 0.3 and 0.35 below 0.4 only (3 of 4): 7 of 8. Reward A beats the baseline on all 8 seeds
    (sign-flip p = 2 / 2^8, tested first at 0.025, its 97.5% interval above 0): shown; reward B is mixed: not shown.
    The three paired differences (+0.05, -0.01, +0.15): sign-flip p = 4 / 8 (flipping the -0.01 gives a larger sum)."""
    assert ns["within"]["auroc"] == 7 / 8 and ns["within"]["pairs"] == 8
    a, b = ns["family"]["reward A"], ns["family"]["reward B"]
    assert a["p"] == 2 / 2 ** 8 and a["alpha"] == 0.025 and a["shown"] and a["difference"]["low"] > 0
    assert b["rank"] == 1 and not b["shown"]
    d = ns["paired_seed_difference"]({0: 0.74, 1: 0.70, 2: 0.81}, {0: 0.69, 1: 0.71, 2: 0.66})
    assert d["differences"] == pytest.approx([0.05, -0.01, 0.15]) and ns["sign_flip_p"](d["differences"]) == 0.5


def _group_scaling_check(ns, request):
    """The page's arithmetic is TRL's: the advantage it computes equals (r - group mean) / (TRL's nanstd + 1e-4), the
    std TRL 1.16's sum-then-normalise divides by (Bessel-corrected)."""
    import torch
    from trl.trainer.utils import nanstd

    for delta in (1.0, 1e-3, 2e-4):
        rewards = torch.tensor([delta] * 4 + [0.0] * 4, dtype=torch.float64)
        trl_advantage = float((rewards[0] - rewards.mean()) / (nanstd(rewards) + 1e-4))
        assert ns["advantage_of_a_difference"](delta) == pytest.approx(trl_advantage, rel=1e-6)


def _none_and_nan_check(ns, request):
    """The prose: TRL's nansum scores the NaN rollout -0.707 in its group while the reward's mean reads 1.0; trl_mdi
    counts None and NaN apart from the reward's own return value."""
    assert ns["advantages"][0].item() == pytest.approx(-0.7071, abs=1e-3)
    assert ns["totals"].tolist() == [1.0, 2.0]


def _completions_table_setup(request):
    """One step of the tiny Qwen2.5-VL with scripted answer-line rollouts (tests/test_reliance_trainer.py), the
    demo's reward stack, reliance signals and the completions table on: the block reads the run's step-1 parquet."""
    from test_reliance_trainer import scripted_generation
    from test_trainer import make_args

    from trl_mdi.trainer import MDIGRPOTrainer

    tmp = request.getfixturevalue("tmp_path")
    scripted_generation(request.getfixturevalue("monkeypatch"))
    trainer = MDIGRPOTrainer(str(request.getfixturevalue("tiny_vlm_dir")("qwen2_5_vl")), reward_funcs=["mc_idx", "think_format", "mdi_balance"],
                             args=make_args(tmp, reliance_signals=True, log_completions=True, max_steps=1,
                                            per_device_train_batch_size=8, num_generations=2),
                             train_dataset=request.getfixturevalue("grpo_train_dataset"))
    trainer.train()
    path = tmp / "out" / "completions" / "completions_00001.parquet"
    return {'"grpo_run/completions/completions_00001.parquet"': repr(str(path))}, {}


def _completions_table_check(ns, request):
    table, blind = ns["table"], ns["blind"]
    assert len(table) == 8 and {"answer_visual_gain", "blind_agrees", "attention/mdi_balance", "image_evidence"} <= set(table)
    # The mdi_balance reward (2 * balance - 1) keeps its column beside the balance signal it reads (TRL's table would
    # let a column of ours named like a reward overwrite it).
    reward, signal = table["mdi_balance"], table["attention/mdi_balance"]
    assert reward.tolist() == pytest.approx((2 * signal - 1).tolist(), nan_ok=True) and signal.notna().any()
    assert list(blind.index) == [i for i, v in enumerate(table["blind_agrees"]) if v == 1]


BLOCKS: tuple[DocBlock, ...] = (
    DocBlock("readme-training-script", "README.md", "MDIGRPOTrainer(model=", RUN, setup=_readme_setup, check=_readme_check),
    DocBlock("concepts-probe-call", "docs/concepts.md", "measure_modality_attention(model", RUN, setup=_probe_setup, check=_probe_check),
    DocBlock("profile-plots", "docs/profile.md", "layer_profile(result)", RUN, context={"result": Instance(ModalityAttention)},
             setup=_profile_setup, check=_profile_check),
    DocBlock("rewards-custom-reward", "docs/rewards.md", "late_vision_reward", RUN, check=_reward_check),
    DocBlock("rewards-none-and-nan", "docs/rewards.md", "count_outcomes([None", RUN, check=_none_and_nan_check),
    # An entry of the SIGNALS tuple in trl_mdi/signals.py: run inside such a tuple, in that module's namespace.
    DocBlock("signals-table-entry", "docs/signals.md", 'Signal("image_mass_{segment}"', RUN, context={"Signal": S.Signal},
             template="NEW_SIGNALS = (\n{code})", setup=lambda request: ({}, dict(vars(S))),
             check=_signal_entry_check),
    DocBlock("signals-reward", "docs/signals.md", "late_look_reward", RUN, check=_signal_reward_check),
    DocBlock("signals-counterfactual-entry", "docs/signals.md", 'Signal("gain_token_share"', RUN,
             context={"Signal": S.Signal, "COUNTERFACTUAL": S.COUNTERFACTUAL, "LOW": S.LOW},
             template="NEW_SIGNALS = (\n{code})", setup=lambda request: ({}, dict(vars(S))),
             check=_counterfactual_entry_check),
    DocBlock("signals-counterfactual-reward", "docs/signals.md", "gain_share_reward", RUN,
             check=_counterfactual_reward_check),
    DocBlock("reliance-statistics", "docs/reliance.md", "within_prompt_auroc(gains", RUN, check=_reliance_statistics_check),
    DocBlock("logs-completions-table", "docs/logs.md", "completions_00001.parquet", RUN,
             setup=_completions_table_setup, check=_completions_table_check),
    DocBlock("rewards-group-scaling", "docs/rewards.md", "def advantage_of_a_difference", RUN,
             check=_group_scaling_check),
)
BLOCKS_BY_MARKER = {b.marker: b for b in BLOCKS}


# ------------------------------------------------------------------------------------------------ static check
def _as_instance(hint) -> Instance | None:
    """Instance(hint) for a plain class (not ``None``, not a generic such as ``dict[str, Any]``)."""
    plain = inspect.isclass(hint) and not isinstance(hint, types.GenericAlias) and hint is not type(None)
    return Instance(hint) if plain else None


def _returned(func) -> Instance | None:
    """What calling ``func`` gives, when it is a class or its return annotation is one."""
    if inspect.isclass(func):
        return Instance(func)
    if isinstance(func, property):
        func = func.fget
    try:
        hint = typing.get_type_hints(func).get("return")
    except Exception:  # annotations the check cannot resolve: the value stays unknown
        return None
    return _as_instance(hint)


def _instances_have(cls: type, attr: str) -> bool:
    """Whether objects of ``cls`` have ``attr``: on the class, a (dataclass) annotation, or ``self.attr =`` in the
    source of a class of its MRO (attributes set in ``__init__``)."""
    if hasattr(cls, attr) or attr in getattr(cls, "__dataclass_fields__", {}):
        return True
    for klass in cls.__mro__:
        if attr in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]*)?=(?!=)", source):
            return True
    return False


def _instance_attribute(cls: type, attr: str):
    """What the static check knows of ``obj.attr`` for an object of ``cls``: a method (to call), or its type."""
    member = inspect.getattr_static(cls, attr, None)
    if isinstance(member, property):
        return _returned(member)
    if callable(member):
        return getattr(cls, attr)
    try:
        hint = typing.get_type_hints(cls).get(attr)
    except Exception:
        return None
    return _as_instance(hint)


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the block binds anywhere (assignments, loops, functions and their parameters, imports, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


class _StaticCheck:
    def __init__(self, context: dict[str, object]):
        self.values: dict[str, object] = dict(context)  # name -> module / class / function / Instance
        self.problems: dict[str, None] = {}  # ordered set

    def problem(self, node: ast.AST, text: str) -> None:
        self.problems[f"line {getattr(node, 'lineno', '?')}: {text}"] = None

    def imports(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                self.problem(node, f"relative import from {'.' * node.level}{node.module or ''}")
                return
            try:
                module = importlib.import_module(node.module)
            except Exception as e:
                self.problem(node, f"cannot import {node.module}: {type(e).__name__}: {e}")
                return
            for alias in node.names:
                if alias.name == "*":
                    self.problem(node, f"from {node.module} import *: the check cannot see the names")
                    continue
                try:
                    value = getattr(module, alias.name) if hasattr(module, alias.name) else importlib.import_module(
                        f"{node.module}.{alias.name}")
                except Exception:
                    self.problem(node, f"{node.module} has no {alias.name!r}")
                    continue
                self.values[alias.asname or alias.name] = value
            return
        for alias in node.names:
            try:
                module = importlib.import_module(alias.name)
            except Exception as e:
                self.problem(node, f"cannot import {alias.name}: {type(e).__name__}: {e}")
                continue
            if alias.asname:
                self.values[alias.asname] = module
            else:  # `import a.b` binds a
                self.values[alias.name.split(".")[0]] = sys.modules[alias.name.split(".")[0]]

    def resolve(self, node: ast.AST):
        """What the check knows of an expression's value (None: nothing), recording every attribute that is missing."""
        if isinstance(node, ast.Name):
            return self.values.get(node.id)
        if isinstance(node, ast.Call):
            func = self.resolve(node.func)
            return None if func is None or isinstance(func, Instance) else _returned(func)
        if not isinstance(node, ast.Attribute):
            return None
        base = self.resolve(node.value)
        if base is None:
            return None
        shown = f"{ast.unparse(node.value)}.{node.attr}"
        if isinstance(base, Instance):
            if not _instances_have(base.cls, node.attr):
                self.problem(node, f"{shown}: {base.cls.__qualname__} has no attribute {node.attr!r}")
                return None
            return _instance_attribute(base.cls, node.attr)
        if hasattr(base, node.attr):
            return getattr(base, node.attr)
        if inspect.ismodule(base):
            try:
                return importlib.import_module(f"{base.__name__}.{node.attr}")
            except ImportError:
                pass
        self.problem(node, f"{shown}: {getattr(base, '__name__', base)!s} has no attribute {node.attr!r}")
        return None

    def statement(self, stmt: ast.stmt) -> None:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports(node)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                self.resolve(node)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = self.resolve(stmt.value)
            if value is None:
                self.values.pop(stmt.targets[0].id, None)
            else:
                self.values[stmt.targets[0].id] = value


def static_problems(code: str, context: dict[str, object] | None = None) -> list[str]:
    """Names a block imports, reads or takes attributes of that do not exist (see the module docstring)."""
    context = context or {}
    tree = ast.parse(code)
    check = _StaticCheck(context)
    known = _bound_names(tree) | set(dir(builtins)) | set(context)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in known:
            check.problem(node, f"{node.id!r} is never imported or bound (if the prose defines it, declare it in the "
                                "block's context)")
    for stmt in tree.body:
        check.statement(stmt)
    return list(check.problems)


# ------------------------------------------------------------------------------------------------ tests
def test_every_python_block_has_a_mode():
    """Each block matches exactly one entry of BLOCKS, and each entry one block; the table lists every mode."""
    blocks = python_blocks()
    assert len(blocks) >= 6, [b.where for b in blocks]
    for block in blocks:
        entries = [e.name for e in BLOCKS if matches(e, block)]
        assert len(entries) == 1, (
            f"the python block at {block.where} matches {entries or 'no entry'} of BLOCKS in tests/test_doc_blocks.py:"
            f" give it one entry (mode {RUN!r}, or {STATIC!r} with why it cannot run here)\n{block.code}")
    for entry in BLOCKS:
        block_of(entry)
        assert entry.mode in (RUN, STATIC), entry
        assert entry.mode == RUN or entry.why, f"{entry.name}: a static block says why it cannot run here"
        assert entry.mode == STATIC or entry.check, f"{entry.name}: a run block checks what its prose promises"
    print("\n".join(f"{block_of(e).where:<22} {e.name:<24} {e.mode:<7} {e.why}" for e in BLOCKS))


def test_python_fences_say_python():
    """A block fenced as ```py, ```python3 or ````python would escape this file's extraction: every Python fence is
    exactly ```python."""
    for path in doc_files():
        for fence, info in re.findall(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+-]+)", path.read_text(encoding="utf-8"), re.M):
            if info.lower().startswith(("py", "ipython")):
                assert (fence, info) == ("```", "python"), f"{path.name}: {fence}{info} (write ```python)"


@pytest.mark.parametrize("entry", BLOCKS, ids=lambda e: f"{e.name}-{e.mode}")
def test_block_names_exist(entry):
    problems = static_problems(entry.template.format(code=block_of(entry).code), entry.context)
    assert not problems, f"{block_of(entry).where}:\n" + "\n".join(problems)


@pytest.mark.parametrize("entry", [e for e in BLOCKS if e.mode == RUN], ids=lambda e: e.name)
def test_block_runs(entry, request, tmp_path, monkeypatch):
    block = block_of(entry)
    swaps, names = entry.setup(request) if entry.setup else ({}, {})
    code = block.code
    for old, new in swaps.items():
        assert old in code, f"the block at {block.where} no longer contains {old!r}: update its entry in BLOCKS"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_block__", **names}
    exec(compile(entry.template.format(code=code), block.where, "exec"), namespace)  # noqa: S102
    entry.check(namespace, request)


# ------------------------------------------------------------------------------------------------ the accessor
def test_rows_are_the_segment_metrics_and_the_balance():
    """``ModalityAttention.rows`` (the documented per-row accessor) against ``segment_metrics`` and ``mdi_balance``
    on hand-made rows: ordinary, no image, image mass 0 in one segment, no measured query; thirds and an explicit
    spec over a hybrid's measured layers."""
    from trl_mdi.attention import metrics as M

    image = torch.tensor([[0.2, 0.1, 0.3, 0.25, 0.05, 0.15], [0.0] * 6, [0.2, 0.2, 0.1, 0.1, 0.0, 0.0], [math.nan] * 6])
    att = ModalityAttention(
        image=image, prompt_text=0.7 - image, completion=torch.full((4, 6), 0.2), special=torch.full((4, 6), 0.1),
        n_image=torch.tensor([8, 0, 6, 8]), n_prompt_text=torch.tensor([20, 12, 9, 20]),
        n_special=torch.zeros(4, dtype=torch.long), n_completion=torch.tensor([5, 4, 3, 0]),
        n_queries=torch.tensor([5, 4, 3, 0]),
    )
    hybrid = ModalityAttention(**{**vars(att), "measured_layers": (0, 2, 3, 5)})
    for result, spec, ratio in ((att, "thirds", 2.0), (att, "early:0-1,late:4-5", 3.0), (hybrid, "a:0-2,b:3-5", 2.0)):
        rows = result.rows(spec, balance_ratio=ratio)
        segments = M.layer_segments(6, spec, result.layers)
        expected = M.segment_metrics(result.prompt_text, result.image, result.n_prompt_text, result.n_image, segments)
        names = [n for n in segments if n != "all"]
        assert [list(r) for r in rows] == [[n for n in S.field_names(names, reward=True) if n != "mdi_group_score"]] * 4
        for i, row in enumerate(rows):
            for segment, metrics in expected.items():
                suffix = "" if segment == "all" else f"_{segment}"
                for key in ("mdi", "aei_text", "aei_image"):
                    value = metrics[key][i].item()
                    assert row[key + suffix] == (None if math.isnan(value) else value), (i, spec, key + suffix)
            balance = M.mdi_balance(expected["all"]["mdi"], ratio)[i].item()
            assert row["mdi_balance"] == (None if math.isnan(balance) else balance)
        assert all(v is None for row in rows[1::2] for v in row.values())  # no image; no measured query
        assert all(isinstance(v, float) for v in rows[0].values())
    assert att.rows()[2]["mdi_late"] == math.inf and att.rows(balance_ratio=2.0)[2]["mdi_balance"] < 1.0
    assert att.rows() == S.rollout_rows({n: v for n, v in S.rollout_signals(att, "thirds", 2.0).items()
                                          if n in att.rows()[0]})


# ------------------------------------------------------------------------------------------------ the check itself
OLD_PROBE_BLOCK = """\
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl_mdi.attention import measure_modality_attention

model = AutoModelForImageTextToText.from_pretrained("/path/to/a/local/vlm", dtype=torch.bfloat16)
res = measure_modality_attention(model, input_ids, attention_mask, completion_mask,
                                 pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                 mm_token_type_ids=mm_token_type_ids)
res.image, res.prompt_text, res.completion    # (B, num_layers) attention masses
res.rows()[0]["mdi_late"], res.rows()[0]["aei_text_all"], res.rows()[0]["mdi_balance"]
"""


def test_static_check_catches_what_the_old_probe_block_got_wrong(monkeypatch):
    """docs/concepts.md's block before issue 23: undefined inputs, ``res.rows`` (absent then), ``trl_mdi.metrics``."""
    problems = "\n".join(static_problems(OLD_PROBE_BLOCK))
    for name in ("input_ids", "attention_mask", "completion_mask", "pixel_values", "mm_token_type_ids"):
        assert f"{name!r} is never imported or bound" in problems
    assert "res.rows" not in problems and "res.image" not in problems  # a method and a dataclass field: found
    monkeypatch.delattr(ModalityAttention, "rows")
    assert "res.rows: ModalityAttention has no attribute 'rows'" in "\n".join(static_problems(OLD_PROBE_BLOCK))
    assert any("has no 'metrics'" in p for p in static_problems("from trl_mdi import metrics"))
    assert any("has no attribute 'metrics'" in p for p in static_problems("import trl_mdi\ntrl_mdi.metrics.mdi"))
    assert static_problems("import trl_mdi.attention\ntrl_mdi.attention.metrics.mdi_balance") == []
