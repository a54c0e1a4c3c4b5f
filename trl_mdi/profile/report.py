"""The profile's files: ``profile.md`` (tables a person reads), ``profile.json`` (the same numbers for code) and the two
pictures (``trl_mdi.diagnostics.plots``); with ``--reliance`` its section and pictures (``reliance_report``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..attention.layer_stats import mass_curve, mdi_curve
from ..diagnostics.markdown import code_span, escape_inline
from ..diagnostics.plots import plot_mass_by_layer, plot_mdi_by_layer
from . import reliance_report

FILES = ("profile.md", "profile.json", "mdi_by_layer.png", "mass_by_layer.png")

HOW_TO_READ = (
    "Masses are the attention of the measured queries ({queries}) on each key group, averaged over heads, then "
    "queries, then rows (mean ± standard deviation over rows). MDI = (A_T / n_T) / (A_O / n_O) from the mean masses "
    "and mean key counts over rows (a ratio of means, as everywhere in trl_mdi): above 1 text gets more attention "
    "per token than the image, below 1 the image does. *MDI of rows* is the 25th-75th percentile of the rows' own "
    "MDI; *rows MDI inf* counts rows whose image mass is exactly 0 there (their own MDI is +inf: counted, never "
    "averaged). AEI = attention share / token share (1: attention proportional to token count). Rows without image "
    "tokens have no MDI and are counted, not averaged.")


def fmt(value, spec: str = ".3f") -> str:
    """A table cell: '–' for no value, 'inf' for +inf.

    >>> fmt(None), fmt(float("inf")), fmt(0.12345), fmt(0.83, "mdi"), fmt(17.37, "mdi"), fmt(-0.0001, "+.3f")
    ('–', 'inf', '0.123', '0.830', '17.4', '+0.000')
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if spec == "mdi":  # three decimals where MDI usually lives, three significant digits past 10
        return format(value, ".3f" if abs(value) < 10 else ".3g")
    text = format(value, spec)
    return text.replace("-", "+" if "+" in spec else "", 1) if float(text) == 0 else text  # no "-0.000"


def _pm(row: dict, key: str) -> str:
    return f"{fmt(row[key])} ± {fmt(row[key + '_std'])}" if row[key] is not None else "–"


def _band(row: dict) -> str:
    return "–" if row["mdi_p25"] is None else f"{fmt(row['mdi_p25'], 'mdi')}–{fmt(row['mdi_p75'], 'mdi')}"


def _metric_table(first: str, entries: list[tuple[str, dict]], extra: str | None = None) -> list[str]:
    head = f"| {first} |" + (f" {extra} |" if extra else "")
    lines = [head + " image mass | prompt-text mass | completion mass | MDI | MDI of rows (p25–p75) | rows MDI inf "
             "| AEI text | AEI image |",
             "|---:|" + ("---|" if extra else "") + "---|---|---|---:|---|---:|---:|---:|"]
    for name, r in entries:
        cells = [escape_inline(name)] + ([_span(r["layers"])] if extra else [])
        cells += [_pm(r, "image"), _pm(r, "prompt_text"), _pm(r, "completion"), fmt(r["mdi"], "mdi"), _band(r),
                  str(r["rows_mdi_inf"]), fmt(r["aei_text"]), fmt(r["aei_image"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _span(layers: list[int]) -> str:
    """'0-3' for a contiguous run, else the list."""
    if len(layers) == 1:
        return str(layers[0])
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))


def _model_section(m: dict) -> list[str]:
    p, rows = m["profile"], m["profile"]["rows"]
    measured = p["measured_layers"]
    layers_line = (f"{p['num_layers']} text layers, all measured" if len(measured) == p["num_layers"] else
                   f"{p['num_layers']} text layers, {len(measured)} measured (softmax attention): {_span(measured)}")
    # Labels, paths and the model's own text are shown as text (trl_mdi.diagnostics.markdown), never as markup.
    lines = [f"## {escape_inline(m['label'])}", "",
             f"{code_span(m['model'])} · {escape_inline(m['model_type'])} · {layers_line} · {rows['profiled']} rows profiled: "
             f"{rows['measured']} measured, {rows['without_image_tokens']} without image tokens (no MDI), "
             f"{rows['unmeasured']} without a measured query · {m['skipped']} skipped (image failed to decode) · "
             f"{m['seconds']:.1f} s", ""]
    if p["mean_image_tokens"] is not None:
        lines += [f"Mean keys per measured row: {p['mean_image_tokens']:.1f} image, "
                  f"{p['mean_prompt_text_tokens']:.1f} prompt text; {p['mean_measured_queries']:.1f} measured "
                  "queries.", ""]
    lines += _metric_table("layer", [(str(r["layer"]), r) for r in p["layers"]])
    lines += ["", "By layer segment (masses averaged over the segment's layers first, then the ratios taken):", ""]
    lines += _metric_table("segment", list(p["segments"].items()), extra="layers")
    example = next((r["completion"] for r in m["rows"] if r["completion"]), None)
    if example is not None:
        lines += ["", f"First completion: {code_span(repr(example.strip()[:120]))}"]
    return lines + [""]


def _comparison(comparison: dict) -> list[str]:
    if not comparison:
        return []
    base = comparison["base"]
    lines = ["## Comparison", ""]
    base = escape_inline(base)
    for label, c in comparison["models"].items():
        label = escape_inline(label)
        lines += [f"### {label} against {base}", "",
                  f"Δ = {label} − {base} (masses); MDI ratio = {label} / {base} (below 1: {label} looks at the "
                  "image more, per token).", ""]
        blocks = [("layer", [(str(r["layer"]), r) for r in c["layers"]])] if "layers" in c else []
        if not blocks:
            lines += ["The models differ in depth (or in which layers are measured): compared by layer segment.", ""]
        blocks.append(("segment", list(c["segments"].items())))
        for first, entries in blocks:
            lines += [f"| {first} | Δ image mass | Δ prompt-text mass | Δ completion mass | MDI {base} | MDI {label} "
                      "| MDI ratio |", "|---:|---:|---:|---:|---:|---:|---:|"]
            for name, r in entries:
                lines.append(f"| {escape_inline(name)} | {fmt(r['image'], '+.3f')} | {fmt(r['prompt_text'], '+.3f')} | "
                             f"{fmt(r['completion'], '+.3f')} | {fmt(r['mdi_base'], 'mdi')} | {fmt(r['mdi'], 'mdi')} | "
                             f"{fmt(r['mdi_ratio'], 'mdi')} |")
            lines.append("")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """``profile.md`` from the report dict (the content of ``profile.json``)."""
    s, d = report["settings"], report["data"]
    queries = ("the generated tokens" if s["query_phase"] == "completion" else
               "the prompt's text tokens after its last image")
    how = ("completions from column " + repr(s["completion_column"]) if s["completion_column"] else
           f"greedy completions of up to {s['max_new_tokens']} tokens" if s["query_phase"] == "completion" else
           "no completion needed")
    lines = ["# Attention profile by layer", "",
             f"`python -m trl_mdi.profile` · data: {escape_inline(d['description'])} · query phase: {s['query_phase']} ({how}) · "
             f"batch size {s['batch_size']} · seed {s['seed']} · device {s['device']}", ""]
    dropped = d["dropped"]
    if dropped or d["skipped_rows"]:
        parts = [f"{n} {escape_inline(why)} (dropped while preparing)" for why, n in sorted(dropped.items())]
        parts += [f"{d['skipped_rows']} image(s) that failed to decode (skipped)"] if d["skipped_rows"] else []
        lines += ["Rows left out: " + "; ".join(parts) + ".", ""]
    lines += ["![MDI by layer, one line per model](mdi_by_layer.png)", "",
              "![Attention mass by layer, stacked by key group](mass_by_layer.png)", "",
              HOW_TO_READ.format(queries=queries), ""]
    for m in report["models"]:
        lines += _model_section(m)
    lines += _comparison(report["comparison"])
    if s.get("reliance"):
        lines += reliance_report.render_reliance(report["models"], {**s["reliance"], **s})
    return "\n".join(lines).rstrip() + "\n"


def _json_ready(value):
    """NaN -> null, ±inf -> "inf" / "-inf" (strict JSON has neither)."""
    if isinstance(value, float):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def write_report(report: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """Write the four files (and, with a reliance section, its pictures) to ``out``; returns ``{file name: path}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    paths["profile.json"].write_text(json.dumps(_json_ready(report), indent=2) + "\n", encoding="utf-8")
    paths["profile.md"].write_text(render_markdown(report), encoding="utf-8")
    models = report["models"]
    what = "generated tokens" if report["settings"]["query_phase"] == "completion" else "prompt text after the image"
    plot_mdi_by_layer({m["label"]: mdi_curve(m["profile"]) for m in models}, paths["mdi_by_layer.png"],
                      title=f"MDI by layer ({what}; band: 25th-75th percentile of rows)")
    plot_mass_by_layer({m["label"]: mass_curve(m["profile"]) for m in models}, paths["mass_by_layer.png"],
                       title=f"Attention mass of the {what}, by layer")
    if report["settings"].get("reliance"):
        paths.update(reliance_report.plot_reliance({m["label"]: m["reliance"] for m in models},
                                                   report["settings"]["reliance"]["counterfactual_image"], out))
    return paths
