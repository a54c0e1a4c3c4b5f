"""The documentation stays true (README.md and every page of docs/): generated tables, commands, metric names,
figures and links come from the code.

1. **Generated tables.** The config reference in docs/config.md (between ``<!-- config-reference:start -->`` and
   ``:end -->``) equals ``python -m trl_mdi.cli.config_doc``; the signal glossary in docs/logs.md (between
   ``<!-- signal-glossary:start -->`` and ``:end -->``: attention/* and reliance/*) equals the table of
   ``trl_mdi/signals.py``. Regenerate both
   with ``python -m trl_mdi.cli.config_doc --update docs/config.md`` / ``--update docs/logs.md``.
2. **Runnable shell blocks.** A fenced ```` ```bash ```` block whose opening fence is on the line right after a
   ``<!-- runnable -->`` comment (invisible when rendered) is executed, each by ``bash -euo pipefail`` from the
   repository root, with ``.venv/bin`` first on ``PATH`` and the Hugging Face libraries offline; the exit status
   must be 0. The one place they may write, ``/tmp/trl_mdi_readme``, is redirected to this test's temporary folder.
   ``make demo`` / ``make test`` and GPU commands are never runnable; instead:
3. **grpo_vlm.py command lines.** Every ``examples/scripts/grpo_vlm.py`` command anywhere in the docs is parsed by
   the script's real parser (``trl_mdi.cli.arguments.parse_args``), so a misspelt or removed flag fails here
   (tests/test_entry_point.py additionally pins the four commands of docs/training.md's "Training on GPUs").
4. **Metric glossary.** Every metric name listed is logged by the code, and every ``attention/*``, ``reliance/*``,
   ``tprl/*`` and ``perf/*`` metric the code logs is listed (``<segment>`` in a name stands for any layer segment).
5. **Figures and links.** Every number quoted in the benchmark section appears in benchmarks/RESULTS.md; every
   relative link or image of every page points to a file that exists, and every anchor to a heading there.
6. **Python blocks** (```` ```python ````) of every page: tests/test_doc_blocks.py runs each or checks its names.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_mdi.cli import config_doc
from trl_mdi.cli.arguments import parse_args

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUNNABLE_MARK = "<!-- runnable -->"
SCRATCH = "/tmp/trl_mdi_readme"  # the only place runnable blocks write; redirected to tmp_path
SCRIPT = "examples/scripts/grpo_vlm.py"
METRIC_PREFIXES = ("attention/", "reliance/", "tprl/", "perf/")


DOCS = ROOT / "docs"


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def doc_files() -> list[Path]:
    """README.md and every page under docs/: the documentation these tests keep true."""
    return [README, *sorted(DOCS.glob("*.md"))]


def all_docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in doc_files())


def section(title: str) -> str:
    """The prose of the section whose ``## `` heading starts with ``title`` (up to the next ``## ``), in whichever
    page of README.md and docs/ holds it.

    Code blocks are left out: the log excerpts hold ``## Step`` lines of their own.
    """
    for path in doc_files():
        text = outside_code_blocks(path.read_text(encoding="utf-8"))
        m = re.search(rf"^## {re.escape(title)}.*?$", text, re.M)
        if m:
            break
    assert m, f"no page has a section '## {title}'"
    rest = text[m.end():]
    end = re.search(r"^## ", rest, re.M)
    return rest[: end.start()] if end else rest


def fenced_blocks(text: str, lang: str) -> list[tuple[str, str, int]]:
    """(line above the fence, body, line number of the opening fence) of every ```<lang> block, in order.

    Fences may be indented (a block inside a list item): the body is dedented by its common indentation.
    """
    blocks = []
    for m in re.finditer(rf"^[ \t]*```{re.escape(lang)}(?:[ \t][^\n]*)?\n(.*?)^[ \t]*```", text, re.S | re.M):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        blocks.append((before, textwrap.dedent(m.group(1)), text.count("\n", 0, m.start()) + 1))
    return blocks


def bash_blocks(text: str) -> list[tuple[bool, str]]:
    """(runnable, body) of every ```bash block, in order; runnable when the line above the fence is the mark."""
    return [(before == RUNNABLE_MARK, body) for before, body, _ in fenced_blocks(text, "bash")]


# ------------------------------------------------------------------------------------------------ 1. config


def test_readme_opens_with_the_two_commands():
    lines = readme_text().splitlines()
    assert lines[2:6] == [
        "```bash",
        "make demo   # set up .venv, then run the main job on the embedded default (tiny VLM + synthetic A-OKVQA, CPU)",
        "make test   # set up .venv, then run the test suite (offline, CPU; CI adds make test-e2e)",
        "```",
    ]


def test_ci_runs_every_test():
    """`make test` leaves out only the tests marked e2e, `make test-e2e` runs exactly those, and .ci/run calls both
    (and the vLLM suite): splitting the suite for time never drops a test from CI."""
    root = Path(__file__).resolve().parents[1]
    make = (root / "Makefile").read_text(encoding="utf-8")
    assert "test: install\n\t$(BIN)/python -m pytest -m \"not e2e\" $(PYTEST_PARALLEL)\n" in make
    # make test-e2e: its parallel half and its serial half (the 2-process launches), together exactly `e2e`.
    e2e = make.split("test-e2e: install\n")[1].split("\n\n")[0]
    assert re.findall(r'pytest -m "([^"]+)"', e2e) == ["e2e and not distributed", "e2e and distributed"]
    assert e2e.count("|| status=1") == 2 and e2e.rstrip().endswith("exit $$status")
    ci = [line for line in (root / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.startswith("make ")]
    assert ci == ["make test", "make test-e2e", "make test-vllm"]
    # The vLLM environment builds in the background from the start: the target is the one `make test-vllm` needs.
    stamp = re.search(r"^VLLM_STAMP := \$\(VLLM_VENV\)(/\S+)$", make, re.M).group(1)
    venv = re.search(r"^VLLM_VENV  := (\S+)$", make, re.M).group(1)
    assert f"setsid make {venv}{stamp} > " in (root / ".ci" / "run").read_text(encoding="utf-8")
    assert "test-vllm: $(VLLM_STAMP)\n" in make


def test_a_two_process_launch_outside_e2e_is_refused_at_collection(request):
    """`make test` runs on 2 xdist workers, so a test that launches 2 processes (marker `distributed`) must be `e2e`
    too, where `make test-e2e` runs it alone: conftest.py refuses the combination at collection, naming the test."""
    hook = next(p.pytest_collection_modifyitems for p in request.config.pluginmanager.get_plugins()
                if str(getattr(p, "__file__", "")).endswith(str(Path("tests") / "conftest.py")))

    class Item:
        def __init__(self, nodeid, *marks):
            self.nodeid, self.marks = nodeid, [m.mark for m in marks]

        def get_closest_marker(self, name):
            return next((m for m in self.marks if m.name == name), None)

    fine = [Item("a.py::launch", pytest.mark.distributed, pytest.mark.e2e), Item("a.py::one"),
            Item("a.py::slow", pytest.mark.slow)]
    hook(request.config, fine)
    with pytest.raises(pytest.UsageError, match=r"1 test\(s\) marked distributed but not e2e: b.py::launch\. .*"
                                                r"add @pytest.mark.e2e"):
        hook(request.config, [*fine, Item("b.py::launch", pytest.mark.distributed, pytest.mark.slow)])


def test_testing_doc_names_every_file_with_e2e_tests():
    """docs/testing.md says what `make test` leaves to `make test-e2e`: every test file holding an e2e test is named
    in that paragraph (a test moved there for time is one a reader of `make test`'s output no longer sees)."""
    import re

    root = Path(__file__).resolve().parents[1]
    text = " ".join((DOCS / "testing.md").read_text(encoding="utf-8").split())  # a name may wrap across lines
    assert "`make test-fast`" in text
    paragraph = text.split("`make test-fast`")[0]
    # The e2e mark, written out or given by fixtures.testing.family_params.
    marked = {path.name for path in (root / "tests").glob("test_*.py")
              if re.search(r"pytest\.mark\.e2e|family_params\(", path.read_text(encoding="utf-8"))}
    assert {"test_demo.py", "test_readme.py", "test_vision_pass.py"} <= marked  # both ways are found
    missing = sorted(name for name in marked if f"`{name}`" not in paragraph)
    assert not missing, f"docs/testing.md does not say these files hold tests `make test` leaves to e2e: {missing}"


def test_config_reference_is_generated_from_the_dataclass():
    embedded = config_doc.embedded_block((DOCS / "config.md").read_text(encoding="utf-8"))
    assert embedded == config_doc.render_table(), (
        "docs/config.md's config reference differs from MDIGRPOConfig: regenerate it with "
        "`python -m trl_mdi.cli.config_doc --update docs/config.md`"
    )
    names = {f.name for f in config_doc.added_fields()}
    assert "compute_attention_metrics" in names and "enable_perception_filtering" in names
    assert "output_dir" not in names  # GRPOConfig's own fields are not ours to document


def test_first_sentence_of_every_help_is_non_empty():
    for f in config_doc.added_fields():
        assert config_doc.first_sentence(f.metadata.get("help", "")), f"{f.name} has no help text"


# ------------------------------------------------------------------------------------------------ 2. commands


@pytest.mark.e2e  # minutes-long (a launch of 2 processes or a whole command): make test-e2e, which CI runs
def test_runnable_blocks_run(tmp_path):
    # `make demo` / `make test` are never marked runnable (minutes; recursive), see the module docstring.
    blocks = [body for runnable, body in bash_blocks(all_docs_text()) if runnable]
    assert len(blocks) >= 3, f"expected the docs' runnable blocks (marked {RUNNABLE_MARK}), found {len(blocks)}"
    for body in blocks:
        assert "make demo" not in body and "make test" not in body, "make demo / make test must not be runnable"
        assert "accelerate launch" not in body, "launch commands are not runnable here"
    venv_bin = ROOT / ".venv" / "bin"
    bin_dir = venv_bin if (venv_bin / "python").exists() else Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1", "PYTHONWARNINGS": "ignore"}
    scratch = str(tmp_path / "trl_mdi_readme")
    for i, body in enumerate(blocks, 1):
        script = body.replace(SCRATCH, scratch)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, (
            f"runnable README block {i} failed (exit {proc.returncode}):\n{body}\n--- stdout\n{proc.stdout[-3000:]}"
            f"\n--- stderr\n{proc.stderr[-3000:]}"
        )


def script_command_lines() -> list[list[str]]:
    """The flags of every grpo_vlm.py command line in the bash blocks of README.md and docs/ (continuations joined)."""
    commands = []
    for _, body in bash_blocks(all_docs_text()):
        for line in body.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            at = [i for i, tok in enumerate(tokens) if tok.endswith(SCRIPT)]
            if at:
                commands.append(tokens[at[0] + 1:])
    return commands


def test_every_grpo_vlm_command_line_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # --config examples/configs/demo.yaml is relative to the repository root
    commands = script_command_lines()
    assert len(commands) >= 8, commands  # demo, dry run, TPRL, the four GPU commands, --help
    for flags in commands:
        if "--help" in flags:
            assert flags == ["--help"], flags
            continue
        try:
            parse_args(flags)  # the script's own parser: unknown flags and invalid values raise
        except (ValueError, SystemExit) as e:
            pytest.fail(f"README command `grpo_vlm.py {' '.join(flags)}` does not parse: {e}")


# ------------------------------------------------------------------------------------------------ 3. metrics


def _source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _library_sources() -> str:
    import transformers
    import trl

    return "\n".join([
        _source(Path(trl.__file__).parent / "trainer" / "grpo_trainer.py"),
        _source(Path(transformers.__file__).parent / "trainer.py"),
    ])


def logged_trl_mdi_metrics() -> set[str]:
    """attention/*, reliance/*, tprl/*, perf/* names trl_mdi logs: computed from the functions that build them, plus
    literals."""
    from trl_mdi import signals as S
    from trl_mdi.answer_tokens import AnswerTokens
    from trl_mdi.attention import ModalityAttention
    from trl_mdi.tprl import apply_tprl

    # Attention: the names come from the keys of the per-rollout table (default layer segments).
    b, layers = 2, 3
    att = ModalityAttention(
        image=torch.full((b, layers), 0.2), prompt_text=torch.full((b, layers), 0.5),
        completion=torch.full((b, layers), 0.2), special=torch.full((b, layers), 0.1),
        n_image=torch.tensor([4, 6]), n_prompt_text=torch.tensor([10, 12]), n_special=torch.tensor([2, 2]),
        n_completion=torch.tensor([3, 3]), n_queries=torch.tensor([3, 3]),
    )
    names = set(S.batch_metrics(S.rollout_signals(att, "thirds", 2.0)))

    # Reliance: the counterfactual values of a hand-made record with every input read (choice logits, the probe's
    # per-token image mass), both rollouts answered.
    answers = AnswerTokens(span_mask=torch.tensor([[False, True, False]] * b), letter_position=torch.tensor([1, 1]),
                           answer_index=torch.tensor([0, 1]), candidates=torch.tensor([[5, 6], [5, 6]]),
                           n_choices=torch.tensor([2, 2]))
    record = S.CounterfactualInputs.of(
        S.PolicyForward(logps=torch.full((b, 3), -1.0), perception={"attention": torch.full((b, 3), 0.1)}),
        S.CounterfactualForward(torch.full((b, 3), -2.0), torch.tensor([[1.0, 0.0], [1.0, 0.0]]), answers),
        torch.ones(b, 3), torch.tensor([True, True]))
    names |= set(S.batch_metrics(S.counterfactual_signals(record)))

    # TPRL: every part on, over a batch with spread (so no branch is skipped).
    out = {"completion_mask": torch.ones(2, 4, dtype=torch.long), "advantages": torch.tensor([1.0, -1.0])}
    args = SimpleNamespace(enable_entropy_filtering=True, top_p_entropy_tokens=0.5, enable_perception_filtering=True,
                           top_p_perception_tokens=0.5, enable_trajectory_reweighting=True,
                           trajectory_scaling_min=0.8)
    names |= set(apply_tprl(out, args, entropies=torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.4, 0.2, 0.8, 0.6]]),
                            perception=torch.tensor([[0.0, 1.0, 0.2, 0.1], [2.0, 3.0, 0.5, 0.4]]),
                            has_image=torch.tensor([True, True]), gather=lambda t: t, process_index=0))

    # Literal names, wherever in the package they are logged: a subscript (`_metrics[mode]["perf/..."]`,
    # `metrics["tprl/..."] = ...`) or a dict key (`{"attention/...": ...}`).
    literal = r"""["']((?:attention|reliance|tprl|perf)/[A-Za-z0-9_/]+)["']"""
    for path in sorted((ROOT / "trl_mdi").rglob("*.py")):
        text = _source(path)
        names |= set(re.findall(rf"\[\s*{literal}\s*\]", text)) | set(re.findall(rf"{literal}\s*:", text))
    return {n for n in names if n.startswith(METRIC_PREFIXES)}


def glossary_names() -> list[str]:
    """Metric names in the first column of the glossary's tables."""
    body = section("Metric glossary")
    return re.findall(r"^\| `([^`]+)`", body, re.M)


def _matches(name: str, template: str) -> bool:
    """A logged metric name against a glossary name, where ``<segment>`` stands for any layer-segment name."""
    return re.fullmatch(re.escape(template).replace(re.escape("<segment>"), r"[A-Za-z_]\w*"), name) is not None


def test_signal_glossary_is_generated_from_the_signal_table():
    embedded = config_doc.embedded_block((DOCS / "logs.md").read_text(encoding="utf-8"), config_doc.GLOSSARY_BLOCK)
    assert embedded == config_doc.render_signal_glossary(), (
        "the attention metric glossary differs from trl_mdi/signals.py: regenerate it with "
        "`python -m trl_mdi.cli.config_doc --update docs/logs.md`"
    )


def test_glossary_lists_every_metric_the_trainer_logs():
    from trl_mdi.signals import QUANTILES

    listed = set(glossary_names())
    # A metric's spread (trl_mdi.signals.spread_metrics: <metric>/p10, /p50, /p90) is listed once, with its metric.
    spread = re.compile("/(?:" + "|".join(f"p{round(q * 100)}" for q in QUANTILES) + ")$")
    assert all(f"/p{round(q * 100)}" in section("Metric glossary") for q in QUANTILES)
    missing = sorted(n for n in logged_trl_mdi_metrics() if not any(_matches(spread.sub("", n), t) for t in listed))
    assert not missing, f"metrics logged by trl_mdi but missing from the README's metric glossary: {missing}"
    assert "rewards/<name>/zero_spread_frac" in listed


def test_every_glossary_name_is_logged_by_the_code():
    ours = logged_trl_mdi_metrics()
    sources = "\n".join(_source(p) for p in sorted((ROOT / "trl_mdi").rglob("*.py"))) + _library_sources()
    names = glossary_names()
    assert len(names) >= 20, names
    for name in names:
        if name.startswith(METRIC_PREFIXES):
            assert any(_matches(n, name) for n in ours), f"glossary lists {name!r}, which trl_mdi does not log"
        elif "<" in name:  # a template such as rewards/<name>/mean: an f-string in the source
            pattern = re.escape(name).replace(re.escape("<name>"), r"\{[^}]+\}")
            assert re.search(pattern, sources), f"glossary template {name!r} matches no f-string in the source"
        else:
            assert re.search(rf"""["']{re.escape(name)}["']""", sources), f"glossary lists {name!r}: not in the source"


# ------------------------------------------------------------------------------------------------ 4. figures, links


def test_benchmark_figures_are_quoted_from_results():
    results = _source(ROOT / "benchmarks" / "RESULTS.md")
    body = section("Tests and benchmarks")
    quoted = re.findall(r"\b\d+\.\d+x\b|\b\d[\d,]*(?:\.\d+)? (?:MiB|GiB|s)\b", body)
    assert quoted, "the benchmark section quotes no measured figure"
    for figure in quoted:
        number = figure.split()[0].rstrip("x")
        assert number in results, (
            f"README quotes {figure!r} but benchmarks/RESULTS.md has no such figure: copy the numbers from RESULTS.md"
        )


def outside_code_blocks(text: str) -> str:
    """The text with fenced code blocks removed (a fence closes on a line of at least as many backticks)."""
    kept, fence = [], None
    for line in text.splitlines():
        m = re.match(r"[ \t]*(`{3,})", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and line.strip() == line.strip()[0] * len(line.strip()) and len(m.group(1)) >= len(fence):
            fence = None
        elif fence is None:
            kept.append(line)
    return "\n".join(kept)


def _slugs(text: str) -> set[str]:
    """GitHub's slug of every heading (lower case, punctuation dropped, spaces to hyphens)."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", outside_code_blocks(text), re.M)}


def test_relative_links_and_images_exist():
    """Every local link of README.md and docs/ points to a file that exists, and every anchor to a heading."""
    checked = 0
    for page in doc_files():
        text = outside_code_blocks(page.read_text(encoding="utf-8"))  # links inside code blocks do not count
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and file.suffix == ".md":
                assert anchor in _slugs(file.read_text(encoding="utf-8")), (
                    f"{page.relative_to(ROOT)} links to {target}: no such heading in {file.relative_to(ROOT)}")
            checked += 1
    assert checked >= 30, checked


def test_readme_is_for_newcomers():
    """README.md keeps the two commands, the demo, the Python example, one GPU recipe and links; reference material
    lives in docs/ (every page is linked from the README's documentation table)."""
    text = readme_text()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "README.md":
            assert f"](docs/{page.name})" in text, f"README does not link docs/{page.name}"


def test_demo_figures_are_quoted_from_results():
    """The demo's figures in docs/demo.md and the README are the ones benchmarks/demo.py recorded in RESULTS.md's
    "## Demo" section (each quoted decimal equals a recorded one rounded to the digits shown)."""
    results = _source(ROOT / "benchmarks" / "RESULTS.md")
    assert "\n## Demo\n" in results, "benchmarks/RESULTS.md has no Demo section: run benchmarks/demo.py"
    recorded = results.split("\n## Demo\n", 1)[1].split("\n## ", 1)[0]
    numbers = [float(x) for x in re.findall(r"-?\d+\.\d+", recorded)]
    seconds = set(re.findall(r"\b(\d+) s\b", recorded))
    demo = _source(ROOT / "docs" / "demo.md")
    readme = _source(ROOT / "README.md")
    quoted = [p for p in re.split(r"\n\s*\n", demo) if p.startswith(("What it shows", "How long", "Two things",
                                                                     "The profile of step"))]
    quoted += [p for p in re.split(r"\n\s*\n", readme) if p.startswith("Held-out greedy accuracy goes from")]
    assert len(quoted) == 5, "the demo paragraphs this test reads were renamed"
    for paragraph in quoted:
        for figure in re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", paragraph):
            digits = len(figure.split(".")[1])
            assert any(round(n, digits) == float(figure) for n in numbers), (
                f"{figure!r} in {paragraph[:60]!r}... is not in RESULTS.md's Demo section: run benchmarks/demo.py "
                "and quote its numbers")
        for sec in re.findall(r"\b(\d+) s\b", paragraph):
            assert sec in seconds or sec == "40", f"{sec} s is not a recorded demo time"
