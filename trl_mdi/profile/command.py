"""``python -m trl_mdi.profile``: check everything that can be checked without weights, then profile each model in
turn and write the report."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..attention.layer_stats import compare, layer_profile
from ..cli.arguments import UsageError
from ..data import DatasetError
from .arguments import PROG, ProfileArguments, check_models, model_labels, parse_args
from .report import fmt, write_report
from .rows import ProfileRows, load_profile_rows


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def profile_model(name: str, label: str, config, processor, rows: ProfileRows, args: ProfileArguments) -> dict:
    """Load one model, measure every row, and return its report entry (weights released afterwards)."""
    import torch

    from .measure import load_model, measure_rows

    torch.manual_seed(args.seed)
    model = load_model(name, dtype=args.dtype, attn_implementation=args.attn_implementation, device=args.device,
                       trust_remote_code=args.trust_remote_code)
    try:
        measured = measure_rows(model, processor, rows.dataset, batch_size=args.batch_size,
                                max_new_tokens=args.max_new_tokens, query_phase=args.query_phase,
                                completion_column=rows.completion_column, progress=args.progress, desc=label)
        reliance = _reliance(model, processor, rows, args, label) if args.reliance else None
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    att = measured.attention
    per_row_mdi = att.segment_metrics(args.layer_segments)["all"]["mdi"].tolist()
    return {
        "label": label, "model": name, "model_type": config.model_type, "seconds": measured.seconds,
        "skipped": len(measured.skipped), "skipped_rows": {str(k): v for k, v in measured.skipped.items()},
        "profile": layer_profile(att, args.layer_segments),
        "rows": [{"row": r, "n_image": int(ni), "n_prompt_text": int(nt), "n_queries": int(nq), "mdi_all": m,
                  "completion": c}
                 for r, ni, nt, nq, m, c in zip(measured.rows, att.n_image.tolist(), att.n_prompt_text.tolist(),
                                               att.n_queries.tolist(), per_row_mdi, measured.completions)],
        "reliance": reliance,
    }


def _reliance(model, processor, rows: ProfileRows, args: ProfileArguments, label: str) -> dict:
    """The reliance section's measurement of one model (``reliance.measure_reliance``) and its summary."""
    from .reference import measure_reliance
    from .reliance_report import summarize_reliance

    m = measure_reliance(model, processor, rows.dataset, args.counterfactual_image, samples=args.samples_per_row,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         completion_column=rows.completion_column, seed=args.seed, segments=args.layer_segments,
                         progress=args.progress, desc=f"{label} reliance")
    return {"kinds": m.kinds, "summary": summarize_reliance(m, seed=args.seed), "prompts": m.prompts,
            "rollouts": m.rollouts, "skipped": {str(k): v for k, v in m.skipped.items()}}


def _check_counterfactuals(processors: dict, rows: ProfileRows, args: ProfileArguments) -> None:
    """Every processor encodes every counterfactual kind of the first row with an image (no weights needed)."""
    from ..data.images import decode_row_images, row_images
    from .reference import check_counterfactuals

    for i in range(min(rows.dataset.num_rows, 64)):
        row = dict(rows.dataset[i])
        if row_images(row) and not decode_row_images([row]):
            break
    else:
        return  # no decodable image near the top: the measurement skips such rows and says so
    for name, processor in processors.items():
        try:
            check_counterfactuals(processor, row["prompt"], row_images(row), args.counterfactual_image, args.seed)
        except ValueError as e:
            raise UsageError(f"--counterfactual_image on {name!r}: {e}") from None


def run(args: ProfileArguments, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Check models and data (no weights), profile every model, write the files; returns the report dict.

    Raises UsageError / ModelCheckError / DatasetError before any weight is loaded when an input is wrong.
    """
    from ..cli.checks import load_processor
    from .measure import resolve_device

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    configs = check_models(args)
    processors = {name: load_processor(name, trust_remote_code=args.trust_remote_code, min_pixels=args.min_pixels,
                                       max_pixels=args.max_pixels) for name in args.model_name_or_path}
    rows = load_profile_rows(args, log)
    if args.reliance:
        _check_counterfactuals(processors, rows, args)
    log(f"profiling {len(configs)} model(s) on {rows.describe()}")
    labels = model_labels(args.model_name_or_path)
    models = [profile_model(name, label, configs[name], processors[name], rows, args)
              for name, label in zip(args.model_name_or_path, labels)]
    report = {
        "settings": {"models": list(args.model_name_or_path), "query_phase": args.query_phase,
                     "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "seed": args.seed,
                     "threads": args.threads, "num_samples": args.num_samples,
                     "completion_column": args.completion_column,
                     "attn_implementation": args.attn_implementation, "dtype": args.dtype,
                     "device": str(resolve_device(args.device)), "layer_segments": args.layer_segments,
                     "measurement": "trl_mdi attention probe (exact)",
                     "reliance": {"counterfactual_image": args.counterfactual_image,
                                  "samples_per_row": args.samples_per_row} if args.reliance else None},
        "data": {"description": rows.describe(), "source": rows.source, "split": rows.split,
                 "rows_in_split": rows.rows_in_split, "rows_prepared": rows.dataset.num_rows,
                 "rows_profiled": rows.dataset.num_rows - models[0]["skipped"],
                 "dropped": rows.dropped, "skipped_rows": models[0]["skipped"],  # the same rows for every model
                 "rows_without_image": rows.without_image},
        "models": models,
        "comparison": compare({m["label"]: m["profile"] for m in models}),
    }
    report["files"] = {k: str(v) for k, v in write_report(report, args.out).items()}
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What the command prints at the end: each model's MDI per segment, and where the files are."""
    width = max(len(m["label"]) for m in report["models"])
    lines = []
    for m in report["models"]:
        segs = " · ".join(f"{name} {fmt(v['mdi'], 'mdi')}" for name, v in m["profile"]["segments"].items())
        lines.append(f"  {m['label']:<{width}}  MDI {segs}  ({m['profile']['rows']['measured']} rows with an MDI)")
    if report["settings"]["reliance"]:
        from .reliance_report import summary_line

        for m in report["models"]:
            lines += summary_line(m["label"], m["reliance"]["summary"])
    f = report["files"]
    if report["settings"]["reliance"]:
        lines.append("reliance: " + ", ".join(str(p) for name, p in f.items() if name.startswith("reliance_")))
    return lines + [f"report:   {f['profile.md']}", f"pictures: {f['mdi_by_layer.png']}, {f['mass_by_layer.png']}",
                    f"numbers:  {f['profile.json']}"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 done, 2 bad input, with one message and no traceback)."""
    start = time.time()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        report = run(args)
    except (UsageError, DatasetError) as e:
        return _fail(str(e))
    print(f"{PROG}: {len(report['models'])} model(s), {report['data']['rows_profiled']} rows, "
          f"{time.time() - start:.0f} s", flush=True)
    print("\n".join(summary_lines(report)), flush=True)
    return 0
