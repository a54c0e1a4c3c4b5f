"""Safe Markdown building blocks: cleaning, escaping, fences, code spans, tables, sparklines. Pure functions.

This module owns how text the writer did not write (model output, data, file and run names, exception messages)
enters a Markdown file the project writes (the two live logs, profile.md, the model card): it stays text, whatever it
holds. Every such piece goes through one of three doors:

* ``fence(clean(text))`` for multi-line text (prompts, completions): a fenced code block whose fence is
  longer than any backtick run inside, so nothing in the text can close it, open HTML or make a heading;
* ``escape_inline(text)`` for single cells and inline values: HTML-escaped (``<``, ``>``, ``&``), Markdown-escaped (a
  backslash before each character that could start an element: code span, emphasis, strikethrough, link, image,
  table cell), what a GFM or linkify renderer links by itself broken up (``//`` as in ``scheme://``, ``www.``, an
  ``@``), newlines as ``<br>``: the value stays on one line, inside its table row, as plain text;
* ``code_span(text)`` for an inline value shown as code outside a table (a token, a file name): a backtick run longer
  than any inside.

Markup the writer formats itself passes through tables as :class:`Markdown`. The files are read raw (``tail -f``)
as often as rendered, so escaping is kept readable: a ``_`` inside a word (``mc_idx_reward``), which can never start
emphasis, is left alone.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

MISSING = "—"
SPARK_CHARS = "▁▂▃▄▅▆▇█"

# C0/C1 control characters except \t and \n, plus DEL. \r is normalised before this runs.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Bidirectional overrides/isolates: invisible, and they reorder how the raw log reads in a terminal.
_BIDI = re.compile(r"[\u202a-\u202e\u2066-\u2069]")
_BACKTICK_RUN = re.compile(r"`+")
# Characters that can open an inline element or end a table cell: escaped with a backslash (the backslash first).
_MD_SPECIAL = re.compile(r"[\\`*\[\]~|]")
# "_" opens or closes emphasis only at a word's edge (CommonMark's flanking rules): inside a word it stays as it is.
_EDGE_UNDERSCORE = re.compile(r"(?<![^\W_])_|_(?![^\W_])")
# What renderers link without any markup (GFM's autolink extension, markdown-it's linkify): "scheme://" and a bare
# "//host" (linkify's protocol-relative links), "www." at a word start, an e-mail's "@". An escape splits the text
# there, so neither sees a link.
_AUTOLINK = re.compile(r"//|(?<![^\W_])(www)\.|@", re.IGNORECASE)
_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def clean(text: Any, max_chars: int | None = None) -> str:
    """Text safe to write: control characters removed (``\\n``, ``\\t`` kept), line ends normalised, capped.

    ``\\r\\n`` and lone ``\\r`` become ``\\n``; Unicode line/paragraph separators become ``\\n``; lone
    surrogates (undecodable bytes) become ``?``. Text longer than ``max_chars`` is cut with a visible
    ``... (N more chars)``.

    >>> clean("a\\r\\nb\\x1b[31mc\\x00", 100)
    'a\\nb[31mc'
    >>> clean("x" * 10, 4)
    'xxxx... (6 more chars)'
    """
    text = "" if text is None else str(text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n")
    text = _BIDI.sub("", _CONTROL.sub("", text))
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates -> "?"
    if max_chars is not None and len(text) > max_chars:
        text = f"{text[:max_chars]}... ({len(text) - max_chars} more chars)"
    return text


def fence(text: str, info: str = "") -> str:
    """A fenced code block that ``text`` cannot close: the fence is longer than any backtick run inside.

    The result ends with a newline; ``text`` should already be ``clean``-ed.

    >>> print(fence("a ```` b", "text"))
    `````text
    a ```` b
    `````
    <BLANKLINE>
    """
    longest = max((len(m) for m in _BACKTICK_RUN.findall(text)), default=0)
    ticks = "`" * max(3, longest + 1)
    body = text if text.endswith("\n") or not text else text + "\n"
    return f"{ticks}{info}\n{body}{ticks}\n"


def escape_inline(text: Any) -> str:
    """One-line, table-safe plain text: no element, image or link can come out of it but the ``<br>`` of its newlines.

    ``<``, ``>``, ``&`` HTML-escaped; a backslash before every backslash, backtick, ``*``, ``[``, ``]``, ``~`` and
    ``|`` and before a ``_`` at a word's edge; ``//`` written ``\\/\\/``, a word-initial ``www.`` as ``www\\.``
    and ``@`` as ``\\@`` (so no renderer links them by itself); tabs as spaces, newlines as ``<br>``.

    >>> escape_inline("a|b <i>\\nc")
    'a\\\\|b &lt;i&gt;<br>c'
    >>> print(escape_inline("![x](https://h/t.png) `code` *em* __init__ mc_idx_reward"))
    !\\[x\\](https:\\/\\/h/t.png) \\`code\\` \\*em\\* \\_\\_init\\_\\_ mc_idx_reward
    """
    text = html.escape(clean(text), quote=False)
    text = _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), text)
    text = _EDGE_UNDERSCORE.sub(r"\\_", text)
    text = _AUTOLINK.sub(lambda m: "\\/\\/" if m.group(0) == "//" else "\\@" if m.group(0) == "@"
                         else m.group(1) + "\\.", text)
    return text.replace("\t", " ").replace("\n", "<br>")


def code_span(text: Any) -> str:
    """``text`` as inline code it cannot close: a backtick run longer than any inside, a space of padding where the text
    starts or ends with a backtick (CommonMark strips it again). For a line, not a table cell (a ``|`` there still ends
    the cell: use :func:`escape_inline`). Newlines become spaces, as a code span shows them; "" for no text.

    >>> code_span("red"), code_span("`"), code_span("a `` b")
    ('`red`', '`` ` ``', '```a `` b```')
    """
    text = clean(text).replace("\n", " ")
    if not text:
        return ""
    ticks = "`" * (max((len(m) for m in _BACKTICK_RUN.findall(text)), default=0) + 1)
    pad = " " if text[0] == "`" or text[-1] == "`" or (text[0] == text[-1] == " " and text.strip()) else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


class Markdown(str):
    """Markup the writer formatted itself (``"**total (weighted)**"``): :func:`format_value`, hence :func:`md_table`,
    puts it in as it is. Never wrap text that came from a model or the data in it."""


def format_value(value: Any) -> str:
    """How numbers and other values appear in tables: None -> "—", floats to 4 significant digits.

    >>> [format_value(v) for v in (None, 3, 0.123456, float("nan"), float("-inf"), True, "a|b")]
    ['—', '3', '0.1235', 'nan', '-inf', 'yes', 'a\\\\|b']
    """
    if value is None:
        return MISSING
    if isinstance(value, Markdown):
        return value
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()  # numpy / torch scalars
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.4g}"
    return escape_inline(value)


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        hasattr(value, "item") and getattr(value, "ndim", None) == 0
    )


def md_table(headers: Sequence[Any], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; numeric columns right-aligned. Ends with a newline.

    Short rows are padded with "—"; long rows raise ValueError (a silent cut would hide data).

    >>> print(md_table(["name", "score"], [["a|b", 0.5], ["c", None]]), end="")
    | name | score |
    |---|---:|
    | a\\|b | 0.5 |
    | c | — |
    """
    rows = [list(r) for r in rows]
    width = len(headers)
    for r in rows:
        if len(r) > width:
            raise ValueError(f"table row has {len(r)} cells but there are {width} headers: {r!r}")
        r.extend([None] * (width - len(r)))
    numeric = [bool(rows) and all(_is_number(r[c]) for r in rows) for c in range(width)]
    lines = [
        "| " + " | ".join(escape_inline(h) for h in headers) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    lines += ["| " + " | ".join(format_value(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _finite(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def sparkline(values: Iterable[Any]) -> str:
    """One character per value, ▁ (min) to █ (max); None/NaN/inf are gaps (a space).

    A constant series is drawn at mid height.

    >>> sparkline([1, 2, None, 3, float("nan"), 8])
    '▁▂ ▃ █'
    >>> sparkline([5, 5])
    '▄▄'
    """
    vals = [_finite(v) for v in values]
    present = [v for v in vals if v is not None]
    if not present:
        return " " * len(vals)
    lo, hi = min(present), max(present)
    top = len(SPARK_CHARS) - 1
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        elif hi == lo:
            out.append(SPARK_CHARS[top // 2])
        else:
            out.append(SPARK_CHARS[round((v - lo) / (hi - lo) * top)])
    return "".join(out)


def trend_line(values: Sequence[Any], width: int = 60, label: str = "") -> str:
    """A one-line trend of the whole series: a sparkline of at most ``width`` characters, min / max / last.

    Up to ``width`` values get one character each. A longer series is cut into ``width`` consecutive bins of
    near-equal size and each character is the mean of its bin's finite values, so the line always spans the whole
    run (a window of the last ``width`` steps would hide the rise from step 1 a user is looking for); the line then
    also gives the mean of the first and of the last tenth of the run. min / max / last are of the raw values.

    >>> trend_line([1.0, 2.0, 1.5], label="MDI")
    'MDI `▁█▅` min 1 · max 2 · last 1.5 (3 points)'
    >>> trend_line([1, 1, 3, 3, 5, 5, 7, 7, 9, 9], width=5)
    '`▁▃▅▆█` min 1 · max 9 · last 9 (10 points, 2 per character) · first 10% mean 1 → last 10% mean 9'
    >>> trend_line([None], label="MDI")
    'MDI (no data yet)'
    """
    vals = [_finite(x) for x in values]
    present = [v for v in vals if v is not None]
    prefix = f"{label} " if label else ""
    if not present or width <= 0:
        return f"{prefix}(no data yet)"
    n = len(vals)
    line = f"min {format_value(min(present))} · max {format_value(max(present))} · last {format_value(vals[-1])}"
    if n <= width:
        return f"{prefix}`{sparkline(vals)}` {line} ({n} point{'s' if n != 1 else ''})"
    bounds = [round(i * n / width) for i in range(width + 1)]
    shown = [_mean_finite(vals[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    per = {hi - lo for lo, hi in zip(bounds, bounds[1:])}
    per_text = f"{min(per)}" if len(per) == 1 else f"{min(per)}-{max(per)}"
    edge = max(1, n // 10)
    first, last = _mean_finite(vals[:edge]), _mean_finite(vals[-edge:])
    return (
        f"{prefix}`{sparkline(shown)}` {line} ({n} points, {per_text} per character)"
        f" · first 10% mean {format_value(first)} → last 10% mean {format_value(last)}"
    )


def _mean_finite(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def iter_lines_outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """(character offset, line) of every line that is not inside a fenced code block (fence lines excluded).

    Follows CommonMark: a fence opens with >= 3 backticks or tildes (up to 3 spaces of indent) and closes with
    a line of the same character, at least as long, and nothing else. Used to find the writers' own markers
    in a log without being fooled by the same text inside a logged completion.

    >>> [line for _, line in iter_lines_outside_fences("a\\n````\\n## x\\n```\\n````\\nb\\n")]
    ['a', 'b']
    """
    for offset, line, outside in _scan_fences(text):
        if outside:
            yield offset, line


def unclosed_fence(text: str) -> str:
    """The line that closes a fence ``text`` leaves open (a log cut mid-block), or "" when every fence closes.

    >>> unclosed_fence("a\\n````text\\nhalf"), unclosed_fence("```\\nx\\n```\\n")
    ('````', '')
    """
    state = ["", 0]
    for _ in _scan_fences(text, state):
        pass
    return state[0] * state[1]


def _scan_fences(text: str, state: list | None = None) -> Iterator[tuple[int, str, bool]]:
    """(offset, line, outside a fence) of every line; ``state`` ([fence char, length]) is left as at the end."""
    offset = 0
    state = state if state is not None else ["", 0]
    lines = text.split("\n")  # only \n: Markdown's line end once clean() has run
    if lines and lines[-1] == "":
        lines.pop()
    for line in lines:
        stripped = line.rstrip("\r")
        open_char, open_len = state
        if open_char:
            m = re.match(r"^ {0,3}(" + re.escape(open_char) + "{" + str(open_len) + r",})\s*$", stripped)
            if m:
                state[:] = ["", 0]
            yield offset, stripped, False
        else:
            m = _FENCE_OPEN.match(stripped)
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
                state[:] = [m.group(1)[0], len(m.group(1))]
                yield offset, stripped, False
            else:
                yield offset, stripped, True
        offset += len(line) + 1
