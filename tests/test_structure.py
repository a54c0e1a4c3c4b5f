"""The library's shape, checked: no import cycle inside trl_mdi (every import counts: module level, inside functions
and under TYPE_CHECKING), no module importing another module's private names, and every module small enough to
read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mdi"
MAX_LINES = 360  # "about 350": a module past this is split along its seams


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
    """(imported trl_mdi module, names taken from it) for every import statement of the module."""
    out = []
    is_package = path.name == "__init__.py"
    known = modules()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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


def test_modules_are_small_enough_to_read_in_one_sitting():
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in modules().items()}
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_big, f"modules over {MAX_LINES} lines (split them along their seams): {too_big}"


def test_the_checks_catch_what_they_look_for():
    """The cycle finder and the import reader on known input, so a green run means something."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    trainer = modules()["trl_mdi.trainer"]
    assert any(t == "trl_mdi.config" and "MDIGRPOConfig" in n for t, n in imports("trl_mdi.trainer", trainer))
