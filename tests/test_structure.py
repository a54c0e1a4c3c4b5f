"""The library's shape, checked: no import cycle inside trl_mdi (every import counts: module level, inside functions
and under TYPE_CHECKING), the maths layer importing nothing above it, no deprecation alias, no module importing another
module's private names, no module importing the repository's fixtures (not shipped in the wheel), one name per
reward (the registry's key is the function's ``__name__``)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mdi"

# The maths layer: pure tensor functions and their records (the attention probe and its statistics, TPRL's formulas
# and image perturbations, the counterfactual comparison). Its modules import one another and nothing else of
# trl_mdi: the trainer, the signal table, the logs and the entry point read them, never the other way round.
MATHS = ("trl_mdi.attention", "trl_mdi.tprl", "trl_mdi.counterfactual")
# What the maths may import from outside trl_mdi besides the standard library.
MATHS_THIRD_PARTY = {"torch", "numpy", "PIL", "transformers", "deepspeed"}

# Modules exempt from the cycle and alias checks: none (issue 34 removed the last deprecation aliases). A module added
# here must say why, and when it leaves.
PENDING: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported trl_mdi module, names taken from it) for every import statement of the module, wherever it stands
    (module level, inside a function, under TYPE_CHECKING); relative imports resolved, and ``from pkg import name``
    where ``name`` is a submodule counted as an import of that submodule."""
    out = []
    is_package = path.name == "__init__.py"
    known = modules()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("trl_mdi")]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, is_package, node)
            if not target.startswith("trl_mdi"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:  # `from . import metrics`: the submodule itself
                    out.append((sub, []))
                else:
                    out.append((target, [alias.name]))
    return out


def fixture_imports(source: str) -> list[str]:
    """The modules of the repository's ``fixtures`` package that ``source`` imports (absolute imports: a relative
    import inside trl_mdi cannot reach a folder beside the package)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "fixtures"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "fixtures":
            found.append(node.module)
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in modules().items():
        edges[name] = {t for t, _ in imports(name, path) if t != name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None. A package's own __init__ importing its submodules is not a
    cycle by itself; a submodule importing its package's __init__ back is."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in edges:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def without(edges: dict[str, set[str]], names: set[str]) -> dict[str, set[str]]:
    """The graph with the ``names`` modules left out (``PENDING``)."""
    return {n: {t for t in targets if t not in names} for n, targets in edges.items() if n not in names}


def test_import_graph_has_no_cycle():
    # A submodule that imports from its own package root while that root imports the submodule is a cycle too.
    cycle = find_cycle(without(graph(), PENDING))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def in_maths(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in MATHS)


def maths_offenders(found: dict[str, Path]) -> list[str]:
    """Each maths module's imports of trl_mdi outside the maths layer, or of a third-party package outside
    ``MATHS_THIRD_PARTY`` (every import statement counts, inside functions too)."""
    offenders = []
    for name, path in found.items():
        if not in_maths(name):
            continue
        offenders += [f"{name} imports {target}" for target, _ in imports(name, path) if not in_maths(target)]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            tops = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else
                    [(node.module or "").split(".")[0]] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{name} imports {top}" for top in tops if top != "trl_mdi" and top != "__future__"
                          and top not in sys.stdlib_module_names and top not in MATHS_THIRD_PARTY]
    return offenders


def test_the_maths_import_nothing_above_them():
    """attention/, tprl/ and the counterfactual comparison are pure functions of tensors: they import one another,
    torch, numpy, PIL, transformers (and deepspeed's parameter gather) and the standard library, nothing of the
    trainer, the signal table, the logs or the entry point."""
    assert {n for n in modules() if in_maths(n)} >= {"trl_mdi.attention.layer_stats", "trl_mdi.tprl.apply",
                                                     "trl_mdi.counterfactual"}
    offenders = maths_offenders(modules())
    assert not offenders, "\n".join(offenders)


def alias_offenders(name: str, path: Path) -> list[str]:
    """Where a module warns of a deprecation: any ``FutureWarning`` / ``DeprecationWarning`` it names, and a
    module-level ``__getattr__`` (PEP 562) other than a package's lazy loader. A lazy loader is the ``__getattr__`` of
    a package's ``__init__.py`` that imports a submodule by name (``importlib.import_module``) and warns of nothing:
    it resolves the package's own public names on first use and aliases no old name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [f"{name}: {node.id} (line {node.lineno})" for node in ast.walk(tree)
             if isinstance(node, ast.Name) and node.id in ("FutureWarning", "DeprecationWarning")]
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__":
            text = ast.unparse(fn)
            lazy_loader = path.name == "__init__.py" and "import_module" in text and "warn" not in text
            if not lazy_loader:
                found.append(f"{name}: module __getattr__ (line {fn.lineno})")
    return found


def test_no_deprecation_alias():
    offenders = [o for name, path in modules().items() if name not in PENDING for o in alias_offenders(name, path)]
    assert not offenders, "deprecation aliases (no release to be compatible with: update the callers):\n" + \
        "\n".join(offenders)


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for name, path in modules().items():
        for target, names in imports(name, path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != name:
                offenders.append(f"{name} imports {private} from {target}")
    assert not offenders, "\n".join(offenders)


def test_no_module_imports_the_repository_fixtures():
    # fixtures/ (tiny models, synthetic data, warm-up, test helpers) lives beside the package and is not in the
    # wheel: a trl_mdi module importing it works from a checkout and fails after `pip install`.
    offenders = {name: found for name, path in modules().items() if (found := fixture_imports(path.read_text("utf-8")))}
    assert not offenders, f"trl_mdi modules importing the repository's fixtures (not shipped): {offenders}"


def interceptions(tree: ast.Module, class_name: str, base_methods: set[str]) -> dict[str, list[str]]:
    """For the class ``class_name`` in ``tree``: each method that overrides one of ``base_methods`` -> the names it
    calls on ``super()``."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in base_methods:
            out[fn.name] = [c.func.attr for c in ast.walk(fn) if isinstance(c, ast.Call)
                            and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Call)
                            and getattr(c.func.value.func, "id", None) == "super"]
    return out


def test_the_trainer_is_one_class_whose_every_interception_calls_super_and_is_documented():
    """MDIGRPOTrainer subclasses GRPOTrainer alone (no mixins calling each other through ``self``); each TRL method
    it intercepts has one body, which calls the same method on ``super()``; docs/differences.md lists each one."""
    from trl import GRPOTrainer

    from trl_mdi import MDIGRPOTrainer

    assert MDIGRPOTrainer.__bases__ == (GRPOTrainer,)
    base_methods = {n for cls in GRPOTrainer.__mro__ for n, v in vars(cls).items() if callable(v)}
    found = interceptions(ast.parse((PACKAGE / "trainer.py").read_text(encoding="utf-8")), "MDIGRPOTrainer",
                          base_methods)
    assert "_calculate_rewards" in found and "__init__" in found  # the reader finds what it looks for
    missing_super = [name for name, calls in found.items() if name not in calls]
    assert not missing_super, f"interceptions that do not call super().<same method>: {missing_super}"
    doc = (PACKAGE.parent / "docs" / "differences.md").read_text(encoding="utf-8")
    undocumented = [name for name in found if f"`{name}`" not in doc]
    assert not undocumented, f"docs/differences.md does not list these interceptions: {undocumented}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The cycle finder, the import reader and the interception reader on known input, so a green run means
    something."""
    known = ast.parse("class T(B):\n    def f(self):\n        return super().f()\n    def g(self):\n"
                      "        return super().f()\n    def h(self):\n        pass\n")
    assert interceptions(known, "T", {"f", "g"}) == {"f": ["f"], "g": ["f"]}  # g calls another method: caught
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert find_cycle(without({"a": {"b"}, "b": {"a"}}, {"b"})) is None
    # A maths module importing the signal table inside a function, and a third-party package not allowed there; one
    # importing torch and another maths module.
    fake = tmp_path / "fake.py"
    fake.write_text("import trl\ndef f():\n    from ..signals import SIGNALS\n", encoding="utf-8")
    assert sorted(maths_offenders({"trl_mdi.attention.fake": fake})) == [
        "trl_mdi.attention.fake imports trl", "trl_mdi.attention.fake imports trl_mdi.signals"]
    fake.write_text("import torch\nfrom . import metrics\nfrom ..tprl.formulas import fit_width\n", encoding="utf-8")
    assert maths_offenders({"trl_mdi.attention.fake": fake}) == []
    # A warning alias, a plain module __getattr__, and a package's lazy loader (allowed only in an __init__.py).
    loader = "import importlib\ndef __getattr__(name):\n    return importlib.import_module(name)\n"
    for file, text, expected in (
            ("m.py", "import warnings\ndef f():\n    warnings.warn('x', FutureWarning)\n", ["m: FutureWarning (line 3)"]),
            ("m.py", "def __getattr__(name):\n    return 1\n", ["m: module __getattr__ (line 1)"]),
            ("m.py", loader, ["m: module __getattr__ (line 2)"]),
            ("__init__.py", loader, [])):
        (tmp_path / file).write_text(text, encoding="utf-8")
        assert alias_offenders("m", tmp_path / file) == expected, text
    trainer = modules()["trl_mdi.trainer"]
    assert any(t == "trl_mdi.config" and "MDIGRPOConfig" in n for t, n in imports("trl_mdi.trainer", trainer))
    source = "import fixtures.tiny\nfrom fixtures import testing\ndef f():\n    from fixtures.synthetic import x\n"
    assert fixture_imports(source) == ["fixtures.tiny", "fixtures", "fixtures.synthetic"]
    assert fixture_imports("import fixturesque\nfrom .fixtures import y\nfrom trl_mdi.fixtures import z\n") == []


def placement_copies(source: str) -> list[str]:
    """Where ``source`` stores a copy of the probe's placement: a class field whose annotation or name speaks of the
    placement, or an attribute assigned the plan's placement (``placement`` / ``batch_placement(...)``) or a
    comparison with a ``ProbePlacement`` member. Reading the plan where the decision is needed (a local name inside
    one function included) is fine."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name != "RunPlan":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    text = ast.unparse(item)
                    if any(w in text for w in ("ProbePlacement", "placement", "rides_trl", "in_training_forward")):
                        found.append(f"{node.name}.{item.target.id}")
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        if any(isinstance(t, ast.Attribute) for t in targets) and node.value is not None:
            value = ast.unparse(node.value)
            if "placement" in value or "ProbePlacement." in value:
                found.append(ast.unparse(node).splitlines()[0])
    return found


def test_the_per_batch_code_holds_no_copy_of_the_placement():
    """Where the probe measures is the run plan's decision (RunPlan.placement, RunPlan.batch_placement): the trainer's
    per-batch records and code ask the plan each time, never keep a copy that could disagree with it."""
    assert placement_copies((PACKAGE / "trainer.py").read_text(encoding="utf-8")) == []
    # The check sees the copies this project once had (StepTiming.rides_trl_forward, BatchRecord.in_training_forward).
    old = ("from dataclasses import dataclass\n@dataclass\nclass StepTiming:\n    rides_trl_forward: bool = False\n"
           "def f(self, record):\n    record.in_training_forward = self.run_plan.placement is ProbePlacement.X\n"
           "    record.where = self.run_plan.batch_placement('train')\n"
           "    where = self.run_plan.batch_placement('train')\n")
    assert placement_copies(old) == ["StepTiming.rides_trl_forward",
                                     "record.in_training_forward = self.run_plan.placement is ProbePlacement.X",
                                     "record.where = self.run_plan.batch_placement('train')"]


def test_the_model_card_names_this_trainer_and_cites_what_it_adds():
    from trl import GRPOTrainer

    from trl_mdi import MDIGRPOTrainer

    assert MDIGRPOTrainer._name == "MDI-GRPO" and "trl_mdi" in MDIGRPOTrainer._tag_names
    paper = MDIGRPOTrainer._paper
    assert paper["id"] == GRPOTrainer._paper["id"] and paper["title"] == GRPOTrainer._paper["title"]
    assert paper["citation"].startswith(GRPOTrainer._paper["citation"])
    for eprint in ("2402.03300", "2508.10552", "2510.09285"):  # GRPO, MDI/AEI, VPPO
        assert f"arXiv:{eprint}" in paper["citation"]


def test_one_name_per_reward():
    """A registry reward is named by its key: TRL logs a reward under its ``__name__`` (``rewards/<name>/mean``), so
    the name in the config and the YAML is the one in the logs and the metrics. The function is
    ``trl_mdi.rewards.<key>``, no other public name there refers to it (no alias), and no key is a name of TRL's own
    rewards (``trl.rewards``), whose metrics would collide with ours."""
    import trl.rewards

    import trl_mdi.rewards as R

    for key, reward in R.REWARD_REGISTRY.items():
        assert reward.__name__ == key, f"registry key {key!r} holds a reward named {reward.__name__!r}"
        assert getattr(R, key) is reward, f"trl_mdi.rewards.{key} is not the registry's {key!r}"
        aliases = [n for n in dir(R) if not n.startswith("_") and n != key and getattr(R, n) is reward]
        assert not aliases, f"{key!r} has other names in trl_mdi.rewards: {aliases}"
    assert not set(R.REWARD_REGISTRY) & set(dir(trl.rewards)), "a registry name shadows one of TRL's rewards"
