"""Hostile text stays text in every Markdown file the project writes (issue 42, item 6): the rollout log, the attention
log, profile.md and the model card (README.md). Each writer gets a hostile corpus in every place that shows text it
did not write (completions, prompts, gold answers, tokens, group ids, run and file names, labels, exception messages)
and its output is rendered by a real Markdown renderer: markdown-it-py with the GFM extensions a viewer adds
(tables, strikethrough, raw HTML, links found in bare text as GitHub finds them).

The check is differential: the same writer, given the same values with every visible character of each text replaced
by ``x`` (lengths, spaces and newlines kept), must render the very same elements with the very same attributes. So
the HTML holds only the writer's own elements: no element, image or link comes from the text, and no text breaks the
writer's own (a fence closed early, a table cell split, a code span cut short)."""

from __future__ import annotations

import collections
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_mdi.diagnostics import AttentionLogWriter, RolloutLogWriter, clean

HOSTILE = [
    "<script>alert(1)</script>",
    '<img src=x onerror="alert(1)"> <a href="https://evil.example">click</a>',
    "![x](https://host.example/t.png) and ![y][ref]\n\n[ref]: https://host.example/u.png",
    "[x](javascript:alert(1)) [y](<javascript:alert(2)>) <https://auto.example> <a@b.example>",
    "https://bare.example/p?q=1 www.bare.example //relative.example/x mail me: someone@host.example",
    "` lone backtick, ``two``, ```` four ````, ending `",
    "</details><details open><summary>pwned</summary>",
    "```\n## Step 99\n```\n~~~\nstill text\n~~~\n<!-- trl_mdi:end step=1 {} -->",
    "*em* _em_ __strong__ ~~gone~~ **bold** \\*escaped\\* \\",
    "| a | b |\n|---|---|\n| c | d \\| e |",
    "# heading\n> quote\n- item\n1. item\n---\n    indented code\nSetext\n===",
    "ctrl\x00\x01\x07\x1b[31mred\x7f \u202eevil\u202c\r\nCRLF\rCR\u2028LS\ttab",
    "&lt;script&gt; &amp; &#60;b&#62; &#x3C;i&#x3E;",
    "$x^2$ :shipit: @user #123 1. not a list",
]

IDS = [re.sub(r"\W+", "_", h[:18]).strip("_") or "blank" for h in HOSTILE]


def neutral(text: str) -> str:
    """``text`` with every visible character an ``x`` (after ``clean``: lengths, spaces and newlines kept)."""
    return re.sub(r"\S", "x", clean(text))


class _Elements(HTMLParser):
    """Every start tag of an HTML document with its attributes, as a multiset."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: collections.Counter = collections.Counter()

    def handle_starttag(self, tag, attrs):
        tag = "strong" if tag == "b" else tag  # the writer's bold, spelt ** or <b> (writers.marked_completion)
        self.elements[(tag, tuple(sorted(attrs)))] += 1

    handle_startendtag = handle_starttag


def render(markdown: str) -> str:
    from markdown_it import MarkdownIt

    md = MarkdownIt("gfm-like")  # CommonMark + tables, strikethrough, raw HTML, linkify
    md.linkify.set({"fuzzy_link": False})  # GitHub links www., scheme:// and e-mail addresses, not bare domains
    return md.render(markdown)


def elements(markdown: str) -> collections.Counter:
    parser = _Elements()
    parser.feed(render(markdown))
    return parser.elements


def assert_only_the_writers_elements(hostile_md: str, neutral_md: str) -> None:
    got, want = elements(hostile_md), elements(neutral_md)
    extra, missing = got - want, want - got
    assert not extra and not missing, (f"elements the text made: {dict(extra)}; writer's elements it broke: "
                                       f"{dict(missing)}")
    assert "<script" not in render(hostile_md).lower()


# --------------------------------------------------------------------------------------------------- the writers
def rollout_log(tmp_path: Path, text: str) -> str:
    """A rollout log with ``text`` in every place it shows text: the config, run name, prompt, completion (full and in
    the table), gold and parsed answer, group, skip reason, the image-evidence and perception tokens, a summary
    extra; then a resume that undoes a step and a "Run stopped" line whose reason holds it."""
    path = tmp_path / "r.md"
    tokens = [" " + text, text, " ok", "`", text + "\n"]
    rollouts = []
    for i in range(3):
        rollouts.append({
            "prompt": [{"role": "system", "content": text},
                       {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            "image_sizes": [(56, 48)], "completion": text, "completion_length": 7,
            "rewards": {"mc_idx": 1.0, "think_format": 0.0}, "reward": 4.0, "advantage": 0.5,
            "answer": text, "parsed": text, "format_ok": True, "group": text, "skipped": text if i == 1 else None,
            "image_evidence": {"tokens": tokens, "marked": [0, 1, 3, 4], "gains": [1.5, 2.0, 3.0, 4.0],
                               "min_gain": 1.0},
            "perception": {"signal": "kl", "top_p": 0.5, "tokens": tokens, "scores": [0.1, 0.9, 0.5, 0.7, 0.3],
                           "kept": [False, True, False, True, True]},
        })
    config = {text: text, "model": text}
    w = RolloutLogWriter(path, run_name=text, config=config, full_rollouts_per_step=2, counterfactual=text)
    w.open()
    w.write_step(1, 0.1, rollouts, {text: text})
    w.write_step(2, 0.2, rollouts, {text: text})
    w.close()
    w = RolloutLogWriter(path, run_name=text, config=config, full_rollouts_per_step=2).open(resume_from_step=1)
    w.write_step(2, 0.2, rollouts, {text: text})
    w.stopped(2, f"RuntimeError: {text}")
    w.close()
    return path.read_text(encoding="utf-8")


def attention_log(tmp_path: Path, text: str) -> str:
    path = tmp_path / "a.md"
    rows = [{"index": i, "group": text, "mdi": 1.5, "mdi_balance": 0.2, "n_image": 4, "n_queries": 3, "note": text}
            for i in range(2)]
    w = AttentionLogWriter(path, columns=[("mdi", "MDI"), ("note", text)], means=[("mdi", text)], run_name=text,
                           config={text: text})
    w.open()
    map_path, rel = w.map_path(1, 0)
    w.write_step(1, 0.1, rows, {text: text}, maps=[(0, rel)], layer_picture="layers.png")
    w.stopped(1, text)
    w.close()
    return path.read_text(encoding="utf-8")


def profile_report(text: str) -> str:
    """profile.md of two models labelled ``text`` (measured on hand-made attention masses), data described by it,
    a dropped-row reason and the first completion holding it, and a reliance section."""
    from trl_mdi.attention import ModalityAttention
    from trl_mdi.attention.layer_stats import compare, layer_profile
    from trl_mdi.profile.report import render_markdown

    t = lambda *rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
    att = ModalityAttention(
        image=t([0.2, 0.1], [0.1, 0.3]), prompt_text=t([0.6, 0.7], [0.8, 0.5]), completion=t([0.2, 0.2], [0.1, 0.2]),
        special=torch.zeros(2, 2), n_image=torch.tensor([4, 8]), n_prompt_text=torch.tensor([40, 20]),
        n_special=torch.zeros(2), n_completion=torch.tensor([3, 3]), n_queries=torch.tensor([3, 3]))
    profile = layer_profile(att, "early:0-0,late:1-1")
    kind = {"accuracy_image": 0.5, "accuracy_counterfactual": 0.25, "multimodal_gain": 0.25, "same_answer_rate": 0.5,
            "blind_answered": 1.0, "means": {}, "rule_table": None, "data_table": None, "agreement": None}
    summary = {"rows_with_image": 2, "rows_with_gold": 2, "data_labels": None, "attention_means": {},
               "kinds": {"black": kind}}
    models = [{"label": f"{text} {i}", "model": text, "model_type": text, "seconds": 1.0, "skipped": 0,
               "profile": profile, "rows": [{"completion": text}],
               "reliance": {"summary": summary}} for i in range(2)]
    report = {
        "settings": {"query_phase": "completion", "completion_column": None, "max_new_tokens": 8, "batch_size": 2,
                     "seed": 0, "device": "cpu", "samples_per_row": 1,
                     "reliance": {"counterfactual_image": ["black"], "samples_per_row": 1}},
        "data": {"description": text, "dropped": {text: 1}, "skipped_rows": 1},
        "models": models,
        "comparison": compare({m["label"]: m["profile"] for m in models}),
    }
    return render_markdown(report)


def model_card(tmp_path: Path, text: str) -> str:
    """The README.md the trainer writes beside every checkpoint (TRL's model card), for an output folder named
    ``text`` (TRL's ``_save_checkpoint`` passes the folder's name)."""
    from trl_mdi.trainer import MDIGRPOTrainer

    trainer = object.__new__(MDIGRPOTrainer)  # only what TRL's create_model_card reads
    trainer.is_world_process_zero = lambda: True
    trainer.model = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(tmp_path)))
    trainer.hub_model_id = None
    trainer.args = SimpleNamespace(output_dir=str(tmp_path))
    MDIGRPOTrainer.create_model_card(trainer, model_name=text)
    return (tmp_path / "README.md").read_text(encoding="utf-8")


WRITERS = {
    "rollout log": lambda tmp_path, text: rollout_log(tmp_path, text),
    "attention log": lambda tmp_path, text: attention_log(tmp_path, text),
    "profile.md": lambda tmp_path, text: profile_report(text),
    "model card": lambda tmp_path, text: model_card(tmp_path, text),
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("text", HOSTILE, ids=IDS)
def test_hostile_text_renders_as_text_in_every_markdown_file(tmp_path, writer, text):
    write = WRITERS[writer]
    (tmp_path / "hostile").mkdir()
    (tmp_path / "neutral").mkdir()
    hostile_md = write(tmp_path / "hostile", text)
    neutral_md = write(tmp_path / "neutral", neutral(text))
    assert_only_the_writers_elements(hostile_md, neutral_md)


def test_the_renderer_would_show_what_the_writers_guard_against():
    """The check can fail: raw, the corpus makes elements (a script, images, links, code, emphasis, a heading)."""
    raw = elements("\n\n".join(HOSTILE))
    tags = {tag for tag, _ in raw}
    assert {"script", "img", "a", "code", "em", "strong", "s", "h1", "details", "table", "blockquote"} <= tags, tags
