"""Generated reference tables: the config reference (every field MDIGRPOConfig adds to GRPOConfig) and the
signal glossary (every attention/* and reliance/* metric of the signal table, ``trl_mdi.signals``).

    python -m trl_mdi.cli.config_doc                    # print the config table
    python -m trl_mdi.cli.config_doc --update FILE.md   # replace every generated block between its markers in FILE

One row per field that ``trl.GRPOConfig`` does not have, in declaration order: name, type, default and the first
sentence of the field's ``help`` metadata; then one row per ``GRPOConfig`` field whose default ``MDIGRPOConfig``
sets, beside GRPOConfig's own default. Every default of trl_mdi is in these tables, once. tests/test_readme.py checks that the block of docs/config.md between
``<!-- config-reference:start -->`` and ``<!-- config-reference:end -->`` equals this output, so a field added
without regenerating docs/config.md fails the suite (the glossary block of docs/logs.md likewise).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path

START_MARKER = "<!-- config-reference:start -->"
END_MARKER = "<!-- config-reference:end -->"
GLOSSARY_BLOCK = "signal-glossary"  # <!-- signal-glossary:start --> ... <!-- signal-glossary:end -->

# A sentence ends at a period that is not part of an ellipsis, followed by whitespace or the end of the text.
_SENTENCE_END = re.compile(r"(?<!\.)\.(?!\.)(?=\s|$)")


def first_sentence(text: str) -> str:
    """The first sentence of a help text, on one line (an ellipsis does not end a sentence).

    >>> first_sentence("Rollouts written in full. The others get one row.")
    'Rollouts written in full.'
    >>> first_sentence("Characters written (then '... (N more chars)').")
    "Characters written (then '... (N more chars)')."
    >>> first_sentence("No period here\\nsecond line")
    'No period here'
    """
    text = text.strip()
    m = _SENTENCE_END.search(text)
    first = text[: m.end()] if m else text.splitlines()[0] if text else ""
    return " ".join(first.split())


def added_fields() -> list[dataclasses.Field]:
    """MDIGRPOConfig's fields that trl.GRPOConfig does not have, in declaration order.

    >>> [f.name for f in added_fields()][:2]
    ['compute_attention_metrics', 'mdi_balance_ratio']
    """
    from trl import GRPOConfig

    from ..config import MDIGRPOConfig

    base = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f for f in dataclasses.fields(MDIGRPOConfig) if f.name not in base]


def _type_name(tp) -> str:
    if isinstance(tp, str):  # postponed annotations (``from __future__ import annotations``)
        return tp
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    """The Markdown tables: one row per added field (name, type, default, first sentence of its help), then one per
    ``GRPOConfig`` field whose default ``MDIGRPOConfig`` sets (with GRPOConfig's default beside it)."""
    from trl import GRPOConfig

    from ..config import MDIGRPOConfig, redeclared_grpo_fields

    # The declared annotations, not field.type: HfArgumentParser rewrites field.type in place (it strips the
    # None of `X | None`), so field.type depends on whether a parser was built earlier in the process.
    hints = typing.get_type_hints(MDIGRPOConfig)

    def meaning(f: dataclasses.Field) -> str:
        return _cell(first_sentence(f.metadata.get("help", "")) or "(no help text)")

    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in added_fields():
        lines.append(f"| `{f.name}` | `{_cell(_type_name(hints[f.name]))}` | {_cell(_default(f))} | {meaning(f)} |")
    theirs = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    lines += ["", "`GRPOConfig` fields whose default `MDIGRPOConfig` sets (the recommended GRPO settings):", "",
              "| field | type | default | `GRPOConfig`'s default | why |", "|---|---|---|---|---|"]
    for f in redeclared_grpo_fields():
        lines.append(f"| `{f.name}` | `{_cell(_type_name(hints[f.name]))}` | {_cell(_default(f))} | "
                     f"{_cell(_default(theirs[f.name]))} | {meaning(f)} |")
    return "\n".join(lines)


def render_signal_glossary() -> str:
    """The attention/* and reliance/* rows of the metric glossary, from the signal table (``trl_mdi.signals.glossary``:
    one row per metric signal, then the batch-level counts)."""
    from ..signals import glossary

    lines = ["| metric | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in glossary()]
    return "\n".join(lines)


def _markers(block: str) -> tuple[str, str]:
    return (START_MARKER, END_MARKER) if block == "config-reference" else (f"<!-- {block}:start -->",
                                                                           f"<!-- {block}:end -->")


_RENDER = {"config-reference": render_table, GLOSSARY_BLOCK: render_signal_glossary}


def embedded_block(readme_text: str, block: str = "config-reference") -> str:
    """The text between a block's markers, stripped; ValueError when the markers are missing."""
    start, end = _markers(block)
    if start not in readme_text or end not in readme_text:
        raise ValueError(f"the file lacks the markers {start} / {end}")
    return readme_text.split(start, 1)[1].split(end, 1)[0].strip()


def update_readme(path: str | Path) -> bool:
    """Replace every generated block whose markers the file holds; True when the file changed."""
    path = Path(path)
    text = original = path.read_text(encoding="utf-8")
    found = False
    for block, render in _RENDER.items():
        start, end = _markers(block)
        if start not in text:
            continue
        found = True
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{render()}\n{end}{tail}"
    if not found:
        raise ValueError(f"{path} holds none of the generated blocks' markers ({', '.join(_RENDER)})")
    if text != original:
        path.write_text(text, encoding="utf-8")
    return text != original


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_mdi.cli.config_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--update", metavar="FILE", help="rewrite the generated blocks between the markers of this file")
    args = parser.parse_args(argv)
    if args.update:
        changed = update_readme(args.update)
        print(f"{args.update}: generated blocks {'updated' if changed else 'already up to date'}")
    else:
        print(render_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
