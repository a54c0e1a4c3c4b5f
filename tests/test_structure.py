"""The library's shape, checked: no import cycle inside trl_mdi (every import counts: module level, inside functions
and under TYPE_CHECKING), no module importing another module's private names, no module importing the repository's
fixtures (not shipped in the wheel), and every module small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mdi"


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


def deprecated_alias_nodes(tree: ast.Module) -> set[int]:
    """The nodes inside a module-level ``__getattr__`` that warns: a deprecated alias resolved at first use, which
    points at a name's new home and is no dependency of the module's own code."""
    out = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__" and "warn" in ast.unparse(fn):
            out |= {id(n) for n in ast.walk(fn)}
    return out


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported trl_mdi module, names taken from it) for every import statement of the module (deprecated aliases
    excepted: :func:`deprecated_alias_nodes`)."""
    out = []
    is_package = path.name == "__init__.py"
    known = modules()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = deprecated_alias_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in aliases:
            continue
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


def test_import_graph_has_no_cycle():
    # A submodule that imports from its own package root while that root imports the submodule is a cycle too.
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


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


def test_the_checks_catch_what_they_look_for():
    """The cycle finder, the import reader and the interception reader on known input, so a green run means
    something."""
    known = ast.parse("class T(B):\n    def f(self):\n        return super().f()\n    def g(self):\n"
                      "        return super().f()\n    def h(self):\n        pass\n")
    assert interceptions(known, "T", {"f", "g"}) == {"f": ["f"], "g": ["f"]}  # g calls another method: caught
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
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
