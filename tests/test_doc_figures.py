"""Every benchmark figure README.md and docs/*.md quote is the one benchmarks/RESULTS.md records now, cell for cell.

A substring search cannot keep docs true: a stale figure usually still occurs somewhere in RESULTS.md as another
cell (the old baseline's 0.695 and 0.054 did). So each quoted figure carries a citation that names its cell, an HTML
comment the Markdown renderer hides, written right after the figure:

    0.981 [0.972, 0.988]<!-- RESULTS: Language prior > `black` (the runs') > answer_visual_gain AUROC -->

- ``Section > row > column``: the table cell of RESULTS.md's ``## Section`` whose row starts with that label (first
  cell) and whose column has that header. Labels and headers are compared with backticks and ``**`` stripped and
  spaces collapsed; exactly one table of the section must have both, else the citation is an error. Where the first
  cell does not single a row out, ``a & b`` names the row by its first two cells (``2048 & 151,936``).
- ``Section > "caption start" > row > column``: the same, in the table whose caption (the last prose line above
  it) starts with that text: for sections where several tables share row labels and headers.
- ``Section > "line start"``: a prose line (a bullet or paragraph line, not a table row) of the section that starts
  with that text (after a leading ``- `` and ``**``); exactly one line must. ``Section > "line start" > after
  "phrase"`` reads the line from the end of the phrase's first occurrence on (``Demo > "Date:" > after "at the
  end"``: the load average, however many numbers the date holds).
- ``#k`` at the end of either form starts at the cell's or line's k-th number (default 1): a cell
  ``0.685 ± 0.041 [0.635–0.740]`` holds three numbers, a bullet line holds many.

**What a citation checks.** The figure is the run of numbers right before the comment, joined only by figure
punctuation (spaces, ``± [ ] ( ) , / – → κ``): ``0.968 [0.958, 0.978]`` is three numbers, ``0.991 vs 0.939`` is
one (the word ends the run). Only a word ends it: in "temperature 0.7, 0.98<!-- ... -->" the run is 0.7 0.98, so
a cited figure right after another number needs a word between them. The run must equal the cell's numbers from
the k-th on, in order, each rounded to the digits the doc shows (0.73 quotes 0.734; 0.7340 would claim a digit RESULTS.md does not have and fails). Numbers
are read with their sign, thousands commas (``2,378``) and a ratio's ``x``; a ``-`` between two digits is a range,
not a sign. Nothing here holds a value: the test compares, so a benchmark that rewrites its section makes every
doc that quotes a changed figure fail, naming the file, the figure and the cell, until the doc is updated.

**Figures that need a citation** (the rule that flags an uncited figure, tuned to stay clear of version numbers,
config values and the log excerpts, which are examples, not results). A *block* is a paragraph, one list item, or a
table; fenced code blocks (the rollout-log excerpts) and inline code are never read. A block is *about a benchmark*
when it names ``RESULTS.md`` or a ``benchmarks/`` script, or already carries a citation; a table is also when the
paragraph right above it (its caption) is. In such a block every figure-looking number must be cited: a decimal
with two or more digits after the point (0.29, 0.695, +0.049), a ratio (1.26x) and a quantity with a unit of the
benchmarks (``222 s``, ``21.8 min``, ``75 MiB``, ``40.0 GiB``). Two escapes, each with its reason:
``<!-- not RESULTS: reason -->`` right after one figure (e.g. a time the demo script itself prints), and
``<!-- no RESULTS figures: reason -->`` anywhere in a block, for a block (or a caption and its table) whose numbers
come from elsewhere (one example run of a tool). Citations in such blocks are still checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def doc_pages(root: Path = ROOT) -> list[Path]:
    """The pages that quote benchmark figures: README.md, docs/*.md and benchmarks/README.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "benchmarks" / "README.md"]


# ----------------------------------------------------------------------------------------------- numbers and cells

# A number: optional sign (only where no digit precedes it: '0.981-1.057' is a range), thousands commas, decimals.
NUMBER = re.compile(r"(?<![\w.])(?:(?<!\d)[+\-−])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
CITATION = re.compile(r"<!--\s*RESULTS:\s*(.*?)\s*-->", re.S)
NOT_RESULTS = re.compile(r"<!--\s*not RESULTS:\s*\S.*?-->", re.S)
NO_FIGURES = re.compile(r"<!--\s*no RESULTS figures:\s*\S.*?-->", re.S)
ANY_COMMENT = re.compile(r"<!--.*?-->", re.S)
# A figure-looking number that must be cited in a block about a benchmark.
FLAGGED = re.compile(r"(?<![\w.])[+\-−]?\d+\.\d{2,}(?!\.?\d)"
                     r"|(?<![\w.])\d+(?:\.\d+)?(?:x|×)(?!\w)"
                     r"|(?<![\w.])\d[\d,]*(?:\.\d+)? (?:s|min|MiB|GiB)\b")


def numbers(text: str) -> list[str]:
    """The numbers of a piece of text, as written (inline code and HTML comments left out)."""
    text = re.sub(r"`[^`]*`", " ", ANY_COMMENT.sub(" ", text))
    return NUMBER.findall(text)


def value(number: str) -> Decimal:
    return Decimal(number.replace(",", "").replace("−", "-").lstrip("+"))


def decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def same_figure(quoted: str, recorded: str) -> bool:
    """``quoted`` is ``recorded`` rounded to the digits ``quoted`` shows (either way at an exact tie); never more
    digits than recorded."""
    d = decimals(quoted)
    if d > decimals(recorded):
        return False
    return abs(value(quoted) - value(recorded)) <= Decimal(5) * Decimal(10) ** (-d - 1)


def _norm(label: str) -> str:
    return " ".join(label.replace("`", "").replace("**", "").split())


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    caption: str = ""  # the prose line right above the table (its caption); "" when a table is right above


@dataclass
class Section:
    title: str
    tables: list[Table]
    lines: list[str]  # prose lines (bullets, paragraphs), table rows excluded


def parse_results(text: str) -> dict[str, Section]:
    """RESULTS.md by ``## `` section: its Markdown tables (header, rows) and its prose lines."""
    sections: dict[str, Section] = {}
    for chunk in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = chunk.partition("\n")
        section = Section(title.strip(), [], [])
        lines = body.splitlines()
        i, after_table = 0, False
        while i < len(lines):
            line = lines[i]
            if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
                # Its caption: the prose line right above it; none when another table came since that line.
                caption = section.lines[-1] if section.lines and not after_table else ""
                table = Table([_norm(c) for c in _cells(line)], [], caption)
                i += 2
                while i < len(lines) and lines[i].startswith("|"):
                    table.rows.append(_cells(lines[i]))
                    i += 1
                section.tables.append(table)
                after_table = True
                continue
            if line.strip():
                section.lines.append(line.strip())
                after_table = False
            i += 1
        if section.title in sections:
            raise ValueError(f"RESULTS.md has two sections '## {section.title}'")
        sections[section.title] = section
    return sections


class CitationError(ValueError):
    pass


def resolve(citation: str, sections: dict[str, Section]) -> tuple[list[str], str]:
    """The numbers of the cell or line a citation names (from its k-th on), and a description of where."""
    k = 1
    m = re.search(r"\s*#(\d+)$", citation)
    if m:
        k, citation = int(m.group(1)), citation[: m.start()]
    parts = [p.strip() for p in citation.split(" > ")]
    caption = None
    if len(parts) == 4 and len(parts[1]) > 2 and parts[1].startswith('"') and parts[1].endswith('"'):
        caption, parts = _norm(parts[1][1:-1]), [parts[0], parts[2], parts[3]]
    line_form = caption is None and len(parts) >= 2 and parts[1].startswith('"')
    after = None
    if line_form and len(parts) == 3:
        m = re.fullmatch(r'after "(.+)"', parts[2])
        after = m.group(1) if m else None
    if len(parts) not in (2, 3) or not all(parts) or (line_form and len(parts) == 3 and after is None):
        raise CitationError(f"a citation is 'Section > row > column', 'Section > \"caption start\" > row > column' "
                            f"or 'Section > \"line start\"' (optionally '> after \"phrase\"'), then optionally "
                            f"'#k', not {citation!r}")
    title = parts[0]
    if title not in sections:
        raise CitationError(f"RESULTS.md has no section '## {title}' (sections: {', '.join(sections)})")
    section = sections[title]
    if line_form or len(parts) == 2:
        start = parts[1]
        if not (start.startswith('"') and start.endswith('"') and len(start) > 2):
            raise CitationError(f"a line citation quotes the line's start: {title} > \"...\", not {parts[1]!r}")
        start = _norm(start[1:-1])
        found = [ln for ln in section.lines if _norm(re.sub(r"^[-*] ", "", ln)).startswith(start)]
        if len(found) != 1:
            raise CitationError(f"{len(found)} lines of '## {title}' start with {start!r} (need exactly one)")
        where, cell = f"'## {title}', the line starting {start!r}", found[0]
        if after is not None:
            if after not in cell:
                raise CitationError(f"{where} does not contain {after!r}")
            where, cell = f"{where} after {after!r}", cell[cell.index(after) + len(after):]
    else:
        row_label, column = _norm(parts[1]), _norm(parts[2])
        keys = [_norm(k) for k in parts[1].split(" & ")]
        hits = []
        for table in section.tables:
            if caption is not None and not _norm(table.caption).startswith(caption):
                continue
            if column not in table.header:
                continue
            rows = [r for r in table.rows if [_norm(c) for c in r[: len(keys)]] == keys]
            if len(rows) > 1:
                raise CitationError(f"'## {title}': a table has {len(rows)} rows {row_label!r}")
            if rows:
                j = table.header.index(column)
                hits.append(rows[0][j] if j < len(rows[0]) else "")
        captioned = "" if caption is None else f" captioned {caption!r}..."
        if len(hits) != 1:
            raise CitationError(f"{len(hits)} tables of '## {title}'{captioned} have a row {row_label!r} and a column "
                                f"{column!r} (need exactly one; several tables share them: name the table by its "
                                "caption, 'Section > \"caption start\" > row > column')")
        where, cell = f"'## {title}'{captioned}, row {row_label!r}, column {column!r}", hits[0]
    found_numbers = numbers(cell)
    if len(found_numbers) < k:
        raise CitationError(f"{where} holds {len(found_numbers)} number(s) ({cell!r}), the citation asks for #{k}")
    listing = ", ".join(f"{i}:{n}" for i, n in enumerate(found_numbers, 1))
    return found_numbers[k - 1:], f"{where} ({listing})"


# ---------------------------------------------------------------------------------------------------- doc pages


def outside_code_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the page outside fenced code blocks (a fence closes on a line of at least as many
    backticks): the rollout-log excerpts are examples, never read as figures."""
    kept, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"[ \t]*(`{3,})", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and set(line.strip()) == {"`"} and len(m.group(1)) >= len(fence):
            fence = None
        elif fence is None:
            kept.append((number, line))
    return kept


@dataclass
class Block:
    text: str
    line_numbers: list[int]  # the page's line number of each line of ``text``
    is_table: bool

    def line_at(self, offset: int) -> int:
        return self.line_numbers[self.text[:offset].count("\n")]


def blocks(text: str) -> list[Block]:
    """Paragraphs, list items and tables: blank lines, headings, list-item starts and table edges split them."""
    out: list[Block] = []
    current: list[tuple[int, str]] = []

    def close():
        if current:
            out.append(Block("\n".join(s for _, s in current), [n for n, _ in current],
                             current[0][1].lstrip().startswith("|")))
            current.clear()

    for number, line in outside_code_blocks(text):
        stripped = line.strip()
        is_row = stripped.startswith("|")
        if not stripped or stripped.startswith("#"):
            close()
            continue
        if current and (re.match(r"([-*+]|\d+\.) ", stripped) or is_row != current[0][1].lstrip().startswith("|")):
            close()
        current.append((number, line))
    close()
    return out


GLUE = set("0123456789.,+-−±[]()/–→κx× ")


def figure_run(text: str) -> str:
    """The run of figure text at the end of ``text``: numbers joined by figure punctuation only (a word ends it),
    with a unit after the last number (``222 s``, ``75 MiB``)."""
    unit = re.search(r"(?<=\d) ?(?:s|min|MiB|GiB)$", text)
    if unit:
        return figure_run(text[: unit.start()]) + unit.group(0) if figure_run(text[: unit.start()]) else ""
    start = len(text)
    while start and text[start - 1] in GLUE:
        start -= 1
    run = text[start:]
    return run if run.rstrip() and run.rstrip()[-1] in "0123456789x×])%" else ""


def _blank_code(text: str) -> str:
    """Inline code blanked (same length, so offsets still give line numbers): a comment shown as code is no
    citation, and a number in code is no figure."""
    return re.sub(r"`[^`\n]*`|<!--.*?-->", lambda c: c.group(0) if c.group(0).startswith("<!--") else
                  " " * len(c.group(0)), text, flags=re.S)


def _about_a_benchmark(block: Block) -> bool:
    return bool(re.search(r"RESULTS\.md|benchmarks/\w+\.py", block.text) or CITATION.search(_blank_code(block.text)))


def _caption(page_blocks: list[Block], index: int) -> Block | None:
    """The paragraph right above a table (one blank line between), if any."""
    block = page_blocks[index]
    if not block.is_table or not index:
        return None
    above = page_blocks[index - 1]
    return above if not above.is_table and block.line_numbers[0] - above.line_numbers[-1] <= 2 else None


def check_page(path: Path, sections: dict[str, Section], name: str | None = None) -> list[str]:
    """Every problem of one page: a citation that does not resolve or whose figure differs from its cell, and an
    uncited figure in a block about a benchmark. Each names the file and line, the figure and the cell."""
    name = name or str(path)
    problems: list[str] = []
    page_blocks = blocks(path.read_text(encoding="utf-8"))
    for index, block in enumerate(page_blocks):
        source = _blank_code(block.text)
        # Citations: each checks the run of numbers right before it (an earlier comment ends the run).
        for m in CITATION.finditer(source):
            at = f"{name}:{block.line_at(m.start())}"
            citation = " ".join(m.group(1).split())
            quoted = numbers(figure_run(ANY_COMMENT.sub("\x00", source[: m.start()])))
            if not quoted:
                problems.append(f"{at}: the citation '{citation}' follows no figure (write it right after the "
                                f"number: 0.981<!-- RESULTS: ... -->)")
                continue
            try:
                recorded, where = resolve(citation, sections)
            except CitationError as err:
                problems.append(f"{at}: figure {' '.join(quoted)}: {err}")
                continue
            if len(recorded) < len(quoted) or not all(same_figure(q, r) for q, r in zip(quoted, recorded)):
                problems.append(f"{at}: quotes {' '.join(quoted)} but RESULTS.md records "
                                f"{' '.join(recorded[: len(quoted)])} at {where}: copy the figure from RESULTS.md "
                                "(rounding allowed, no extra digits)")
        # Uncited figures in a block about a benchmark (or in the table under such a caption).
        caption = _caption(page_blocks, index)
        exempt = NO_FIGURES.search(source) or (caption is not None and NO_FIGURES.search(_blank_code(caption.text)))
        if exempt or not (_about_a_benchmark(block) or (caption is not None and _about_a_benchmark(caption))):
            continue
        # Blank the run each citation or exemption covers, the comments themselves and inline code (same length,
        # so offsets still give line numbers); what is left must hold no figure.
        text = source
        for m in [*CITATION.finditer(source), *NOT_RESULTS.finditer(source)]:
            run = figure_run(ANY_COMMENT.sub("\x00", source[: m.start()]))
            text = text[: m.start() - len(run)] + " " * (len(run) + m.end() - m.start()) + text[m.end():]
        text = ANY_COMMENT.sub(lambda c: " " * len(c.group(0)), text)
        for f in FLAGGED.finditer(text):
            problems.append(f"{name}:{block.line_at(f.start())}: {f.group(0)!r} looks like a benchmark figure "
                            "without a citation (add <!-- RESULTS: Section > row > column --> right after it, or "
                            "<!-- not RESULTS: why --> if it is not one)")
    return problems


def check_docs(pages: list[Path], results: Path, root: Path = ROOT) -> list[str]:
    sections = parse_results(results.read_text(encoding="utf-8"))
    problems: list[str] = []
    for page in pages:
        name = str(page.relative_to(root)) if page.is_relative_to(root) else str(page)
        problems += check_page(page, sections, name)
    return problems


# ------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_figure_is_its_cell(page):
    problems = check_docs([page], RESULTS)
    assert not problems, "\n".join(problems)


def test_results_tables_are_well_formed():
    """What citations resolve against: one section per title, every table row as wide as its header."""
    sections = parse_results(RESULTS.read_text(encoding="utf-8"))
    for section in sections.values():
        for table in section.tables:
            for row in table.rows:
                assert len(row) == len(table.header), (section.title, table.header[0], row)


def test_the_docs_cite_the_benchmarks():
    """The check has something to check: the pages that quote each benchmark carry citations into its section."""
    cited: dict[str, int] = {}
    for page in doc_pages():
        for m in CITATION.finditer(page.read_text(encoding="utf-8")):
            section = m.group(1).split(" > ")[0].strip()
            cited[section] = cited.get(section, 0) + 1
    sections = parse_results(RESULTS.read_text(encoding="utf-8"))
    for title in ("Demo", "Language prior", "Learning check", "Trainer overhead: MDIGRPOTrainer vs GRPOTrainer",
                  "Attention probe: memory and time"):
        assert title in sections, f"RESULTS.md lost its section '## {title}'"
        assert cited.get(title, 0) >= 3, (title, cited)


RESULTS_FIXTURE = """# Benchmark results

## Language prior

Reproduce: `python benchmarks/language_prior.py`. Wall time: 21.8 min from the warm-up's start.

| signal | n (prior-following) | AUROC [95% CI] | mean, prior-following | mean, image-following |
|---|---:|---:|---:|---:|
| MDI all | 1311 (784) | 0.745 [0.717, 0.774] | 0.991 | 0.939 |
| MDI late | 1311 (784) | 0.563 [0.531, 0.592] | 0.919 | 0.891 |

| variant | seeds | conflict acc. |
|---|---:|---:|
| answer + format only | 0,1,2,3,4 | 0.685 ± 0.041 [0.635–0.740] |
| + `mdi_balance` (4:1:1) | 0,1,2 | 0.728 ± 0.091 [0.645–0.825] |

- Goal: warm-up 0.981 [0.972, 0.988]: met; ranges 0.981 - 1.057.

## Demo

- Wall time: 222 s for the whole demo, 189 s of it the GRPO step (200 steps, 2 processes, ZeRO-3).
"""

DOC_FIXTURE = """# A page

Measured ([RESULTS.md](RESULTS.md)): MDI 0.991<!-- RESULTS: Language prior > MDI all > mean, prior-following --> on
prior-following answers against 0.939<!-- RESULTS: Language prior > MDI all > mean, image-following -->, AUROC
0.745 [0.717, 0.774]<!-- RESULTS: Language prior > MDI all > AUROC [95% CI] -->; the baseline
0.685 ± 0.041<!-- RESULTS: Language prior > answer + format only > conflict acc. --> and with `mdi_balance`
0.73<!-- RESULTS: Language prior > + mdi_balance (4:1:1) > conflict acc. -->; 222 s<!-- RESULTS: Demo > "Wall time" -->
(189 s<!-- RESULTS: Demo > "Wall time" #2 --> of it GRPO), 21.8 min<!-- RESULTS: Language prior > "Reproduce:" -->,
ranges 0.981-1.057<!-- RESULTS: Language prior > "Goal:" #4 -->, about 40 s<!-- not RESULTS: the script's warning -->.

The rollout log (an example, not a result; no benchmark named here): reward 4.82, advantage -0.004744.

```text
Answer: A  reward 4.82 · see RESULTS.md 0.695
```
"""


def _write(tmp_path, doc=DOC_FIXTURE, results=RESULTS_FIXTURE):
    (tmp_path / "page.md").write_text(doc, encoding="utf-8")
    (tmp_path / "RESULTS.md").write_text(results, encoding="utf-8")
    return check_docs([tmp_path / "page.md"], tmp_path / "RESULTS.md", root=tmp_path)


def test_a_page_that_quotes_its_cells_passes(tmp_path):
    assert _write(tmp_path) == []


def test_a_changed_result_fails_naming_file_figure_and_cell(tmp_path):
    """The benchmark rewrote a cell: the doc's figure is stale, although 0.939 still occurs in RESULTS.md (another
    cell), which a substring search would accept."""
    changed = RESULTS_FIXTURE.replace("| 0.991 | 0.939 |", "| 0.991 | 0.891 |").replace("| 0.919 | 0.891 |",
                                                                                          "| 0.919 | 0.939 |")
    problems = _write(tmp_path, results=changed)
    assert len(problems) == 1, problems
    assert problems[0].startswith("page.md:4: quotes 0.939 but RESULTS.md records 0.891 at '## Language prior', "
                                  "row 'MDI all', column 'mean, image-following'"), problems[0]


def test_a_changed_doc_figure_fails(tmp_path):
    """The old 3-seed baseline pasted over the current one: 0.695 is no cell's value in this row."""
    problems = _write(tmp_path, doc=DOC_FIXTURE.replace("0.685 ± 0.041", "0.695 ± 0.054"))
    assert len(problems) == 1 and "quotes 0.695 0.054 but RESULTS.md records 0.685 0.041" in problems[0], problems
    assert "row 'answer + format only', column 'conflict acc.'" in problems[0]
    # Rounding: coarser is fine (0.73 for 0.728), a wrong last digit or a digit RESULTS.md does not have is not.
    assert _write(tmp_path, doc=DOC_FIXTURE.replace("0.73<", "0.72<")) != []
    assert _write(tmp_path, doc=DOC_FIXTURE.replace("0.73<", "0.7280<")) != []
    assert _write(tmp_path, doc=DOC_FIXTURE.replace("222 s<", "223 s<"))[0].startswith("page.md:7: quotes 223")


def test_uncited_figures_are_flagged_in_blocks_about_a_benchmark(tmp_path):
    doc = DOC_FIXTURE.replace("0.73<!-- RESULTS: Language prior > + mdi_balance (4:1:1) > conflict acc. -->", "0.73")
    problems = _write(tmp_path, doc=doc)
    assert len(problems) == 1 and problems[0].startswith("page.md:7: '0.73' looks like a benchmark figure without"), problems
    # Units and ratios too; the exemption marker covers one figure.
    problems = _write(tmp_path, doc=DOC_FIXTURE.replace("<!-- not RESULTS: the script's warning -->", "") + "\n")
    assert [p.split(": ", 1)[1][:7] for p in problems] == ["'40 s' "], problems
    # A block naming no benchmark (the excerpt paragraph) and code blocks are not read; a block-level exemption.
    assert _write(tmp_path, doc=DOC_FIXTURE + "\nSee RESULTS.md: 0.52 and 1.5x.\n")[-1].endswith("if it is not one)")
    exempt = DOC_FIXTURE + "\nSee RESULTS.md<!-- no RESULTS figures: one example run -->: 0.52 and 1.5x.\n"
    assert _write(tmp_path, doc=exempt) == []


def test_tables_under_a_benchmark_caption_are_checked(tmp_path):
    doc = DOC_FIXTURE + ("\nFrom `benchmarks/language_prior.py`:\n\n| signal | AUROC |\n|---|---:|\n"
                         "| MDI all | 0.745 [0.717, 0.774]<!-- RESULTS: Language prior > MDI all > AUROC [95% CI] --> |\n"
                         "| MDI late | 0.563 |\n")
    problems = _write(tmp_path, doc=doc)
    assert len(problems) == 1 and problems[0].startswith("page.md:22: '0.563'"), problems


@pytest.mark.parametrize("citation, message", [
    ("Language priors > MDI all > AUROC [95% CI]", "no section '## Language priors'"),
    ("Language prior > MDI > AUROC [95% CI]", "0 tables of '## Language prior' have a row 'MDI'"),
    ("Language prior > MDI all > AUROC", "column 'AUROC'"),
    ("Language prior > MDI all > AUROC [95% CI] #4", "holds 3 number(s)"),
    ("Language prior > Goal:", "quotes the line's start"),
    ("Demo > \"Wall\" > x > y", "0 tables of '## Demo' captioned 'Wall'"),
    ("Demo > \"Wall\" > x > y > z", "a citation is"),
    ("Demo > \"Wall\" > x", "a citation is"),
    ("Demo > \"Wall\" > after \"on CPU\"", "does not contain 'on CPU'"),
])
def test_a_citation_that_does_not_resolve_is_an_error(tmp_path, citation, message):
    problems = _write(tmp_path, doc=f"# p\n\nMDI 0.745<!-- RESULTS: {citation} -->.\n")
    assert len(problems) == 1 and message in problems[0], problems


def test_sections_and_tables_are_parsed_by_heading_row_and_column():
    sections = parse_results(RESULTS_FIXTURE)
    assert list(sections) == ["Language prior", "Demo"]
    assert [t.header[0] for t in sections["Language prior"].tables] == ["signal", "variant"]
    assert resolve("Language prior > MDI late > AUROC [95% CI] #2", sections)[0] == ["0.531", "0.592"]
    assert resolve("Language prior > answer + format only > conflict acc.", sections)[0] == [
        "0.685", "0.041", "0.635", "0.740"]
    assert resolve("Language prior > MDI late & 1311 (784) > mean, image-following", sections)[0] == ["0.891"]
    assert resolve('Demo > "Wall time" #2', sections)[0] == ["189", "200", "2", "3"]
    assert resolve('Demo > "Wall time" > after "demo," #2', sections)[0] == ["200", "2", "3"]  # 189, 200, ...
    assert numbers("0.981-1.057, -0.052 +0.033 (κ 0.94, n 1,311) 1.26x") == [
        "0.981", "1.057", "-0.052", "+0.033", "0.94", "1,311", "1.26"]
    assert same_figure("0.73", "0.734") and same_figure("0.75", "0.745") and same_figure("0.74", "0.745")
    assert not same_figure("0.72", "0.734") and not same_figure("0.7340", "0.734")


def test_tables_sharing_rows_and_columns_are_told_apart_by_their_caption(tmp_path):
    """Two detection tables of one section (warm-up and conflict rows) have the same rows and headers: the plain
    citation is ambiguous, the caption form names each."""
    results = ("## Look\n\nwarm-up, non-conflict rows (the goal):\n\n| signal | AUROC |\n|---|---:|\n| mdi | 0.628 |\n\n"
               "warm-up, conflict rows:\n\n| signal | AUROC |\n|---|---:|\n| mdi | 0.615 |\n")
    sections = parse_results(results)
    assert resolve('Look > "warm-up, non-conflict" > mdi > AUROC', sections)[0] == ["0.628"]
    assert resolve('Look > "warm-up, conflict rows" > mdi > AUROC', sections)[0] == ["0.615"]
    with pytest.raises(CitationError, match="2 tables of '## Look' have a row 'mdi'.*caption"):
        resolve("Look > mdi > AUROC", sections)
    doc = "# p\n\nSee RESULTS.md: 0.615<!-- RESULTS: Look > \"warm-up, non-conflict\" > mdi > AUROC -->.\n"
    problems = _write(tmp_path, doc=doc, results=results)
    assert len(problems) == 1 and "records 0.628" in problems[0], problems


def _bump_last_digit(text: str, end: int) -> tuple[str, int]:
    """``text`` with the last digit before ``end`` changed (by 5, so no rounding hides it), and its offset."""
    pos = max(i for i in range(end) if text[i].isdigit())
    return text[:pos] + str((int(text[pos]) + 5) % 10) + text[pos + 1:], pos


@pytest.mark.parametrize("page", ["README.md", "docs/rewards.md"])
def test_a_stale_figure_in_a_real_page_fails(tmp_path, page):
    """The real page, its first cited figure edited in a copy: the check names the page and line, the figure as
    now written and the RESULTS.md cell it should equal."""
    text = (ROOT / page).read_text(encoding="utf-8")
    m = next(CITATION.finditer(_blank_code(text)))
    stale, pos = _bump_last_digit(text, m.start())
    (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / page).write_text(stale, encoding="utf-8")
    problems = check_docs([tmp_path / page], RESULTS, root=tmp_path)
    line = stale[:pos].count("\n") + 1
    quoted = " ".join(numbers(figure_run(stale[: m.start()])))
    recorded, where = resolve(" ".join(m.group(1).split()), parse_results(RESULTS.read_text(encoding="utf-8")))
    assert problems == [f"{page}:{line}: quotes {quoted} but RESULTS.md records "
                        f"{' '.join(recorded[: len(quoted.split())])} at {where}: copy the figure from RESULTS.md "
                        "(rounding allowed, no extra digits)"]


def test_a_changed_cell_of_the_real_results_fails_the_real_readme(tmp_path):
    """A benchmark rerun changes a cell the README cites: the README (unchanged) fails, naming the cell."""
    sections = parse_results(RESULTS.read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cites = [" ".join(m.group(1).split()) for m in CITATION.finditer(_blank_code(readme))]
    title, row, column = next(c.split(" > ") for c in cites if c.count(" > ") == 2 and '"' not in c)
    table = next(t for t in sections[title].tables if _norm(column) in t.header
                 and any(_norm(r[0]) == _norm(row) for r in t.rows))
    cells = next(r for r in table.rows if _norm(r[0]) == _norm(row))
    j = table.header.index(_norm(column))
    lines = RESULTS.read_text(encoding="utf-8").split("\n")
    start = lines.index(f"## {title}")
    i = next(i for i in range(start, len(lines)) if lines[i].startswith("|") and _cells(lines[i]) == cells)
    new_cell, _ = _bump_last_digit(cells[j], len(numbers(cells[j])[0]) + cells[j].index(numbers(cells[j])[0]))
    lines[i] = "| " + " | ".join([*cells[:j], new_cell, *cells[j + 1:]]) + " |"
    (tmp_path / "RESULTS.md").write_text("\n".join(lines), encoding="utf-8")
    problems = check_docs([ROOT / "README.md"], tmp_path / "RESULTS.md")
    assert problems and all(p.startswith("README.md:") for p in problems), problems
    assert all(f"records {numbers(new_cell)[0]}" in p and f"row {_norm(row)!r}, column {_norm(column)!r}" in p
               for p in problems), problems
