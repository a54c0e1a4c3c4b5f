"""benchmarks/language_prior.py's held-out evaluation: accuracy on conflict and non-conflict rows and MDI, and the
reliance experiment's measurement (``trl_mdi.profile.reference.measure_reliance`` on the held-out conflict rows)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

from fixtures.warmup import WarmupRecipe, evaluate_accuracy, synthetic_dataset
from trl_mdi.evaluation import score_completions

SIGNALS = ("mdi", "mdi_late", "answer_image_attention", "visual_gain", "answer_visual_gain", "blind_agrees")
"""The per-rollout signals the benchmark reports (``mdi``: all layers), in table order."""
KIND_SIGNALS = ("visual_gain", "answer_visual_gain", "blind_agrees")
"""Of them, those that depend on the counterfactual kind."""


class HeldOut:
    """Held-out rows (with images and, for the accuracy evaluation, blank) and scoring split by conflict /
    non-conflict rows. The default is the test rows (split validation, the recipe's data seed, ``s.n_eval`` rows):
    every reported figure. ``split``, ``n`` and ``exclude`` make another split of the same generator (the
    development split, where the counterfactual kind is chosen): ``exclude`` holds image keys (:func:`image_keys`)
    of rows the split must not share, and rows with such an image are dropped (``self.excluded`` counts them)."""

    def __init__(self, s, recipe: WarmupRecipe, *, split: str = "validation", n: int | None = None,
                 blank: bool = True, exclude: frozenset[str] = frozenset()):
        data = dict(split=split, seed=recipe.data_seed, kinds=recipe.kinds, option_order=recipe.option_order,
                    image_size=recipe.image_size, conflict_rate=s.eval_conflict_rate)
        n = s.n_eval if n is None else n
        self.split = split
        self.ds = synthetic_dataset(n, **data)
        keep = [i for i, key in enumerate(image_keys(self.ds)) if key not in exclude]
        self.excluded = n - len(keep)
        self.blank = synthetic_dataset(n, blank_images=True, **data) if blank else None
        if self.excluded:
            self.ds = self.ds.select(keep)
            self.blank = None if self.blank is None else self.blank.select(keep)
        self.s = s
        flags = self.ds["conflict"]
        self.rows = {"conflict": [i for i, c in enumerate(flags) if c], "plain": [i for i, c in enumerate(flags) if not c]}
        self.labels, self.prior = self.ds["label_idx"], self.ds["prior_idx"]

    def evaluate(self, model, processor, *, blank: bool = False) -> dict:
        """Greedy accuracy on conflict / non-conflict rows, how often conflict rows got the prior's answer, and
        the mean MDI (all layers, late segment) of the greedy answers."""
        if blank and self.blank is None:
            raise ValueError(f"the {self.split} rows were built without their blank copies (blank=False)")
        r = evaluate_accuracy(model, processor, self.blank if blank else self.ds,
                              max_new_tokens=self.s.eval_max_new_tokens, measure_attention=True)

        def acc(rows, labels):
            return score_completions([r.completions[i] for i in rows], [labels[i] for i in rows]).accuracy

        out = {"accuracy": r.accuracy, "format": r.format_rate, "clean": r.clean_rate, "seconds": round(r.seconds, 2),
               "prior_follow": acc(self.rows["conflict"], self.prior), "example": r.completions[0]}
        for name, rows in self.rows.items():
            out[name] = acc(rows, self.labels)
            for seg in ("all", "late"):
                out[f"mdi_{seg}_{name}"] = r.mean_mdi(seg, rows)
        for seg in ("all", "late"):
            out[f"mdi_{seg}"] = r.mean_mdi(seg)
        return out

    def conflict_rows(self, n: int):
        """The first ``n`` held-out conflict rows (every one when fewer): the prompts of the reliance measurement."""
        return self.ds.select(self.rows["conflict"][:n])

    def reliance(self, model, processor, kinds, *, prompts: int, samples: int, max_new_tokens: int,
                 n_boot: int = 1000, seed: int = 0) -> dict:
        """The reliance experiment on ``prompts`` held-out conflict rows: ``samples`` completions per row sampled at
        temperature 1 (``measure_reliance``; its greedy rollout 0 only gives the row's answer), every rollout
        scored with the real image and each counterfactual ``kind``, and ``summarize_reliance``'s tables over the
        SAMPLED rollouts: per kind every signal's AUROC against the data's own label (a conflict rollout answering
        the object's usual colour is prior-following, one answering the drawn colour image-following, any other
        left out), pooled and within-prompt, with intervals from a bootstrap over prompts, every signal on the rollouts
        where all are defined, its within-group variance share, and the general rule's agreement with that label.
        Returns a JSON-ready dict (see :func:`compact_summary`) with the per-rollout ``records`` beside the tables
        (:func:`rollout_records`; :func:`recompute` rebuilds the tables from them)."""
        from trl_mdi.profile.reference import measure_reliance

        was_training = model.training
        model.eval()
        try:
            m = measure_reliance(model, processor, self.conflict_rows(prompts), list(kinds), samples=samples,
                                 max_new_tokens=max_new_tokens, batch_size=32, seed=seed)
        finally:
            model.train(was_training)
        sampled = dataclasses.replace(m, rollouts=[r for r in m.rollouts if r["sample"] > 0])
        return summarize(sampled, n_boot=n_boot, seed=seed)


def image_keys(ds) -> list[str]:
    """Per row, the SHA-256 of its image file's bytes (the PNG the generator drew): equal keys, equal images. What a
    split's rows are checked against another's with (``HeldOut(exclude=...)``)."""
    from datasets import Image

    return [hashlib.sha256(img["bytes"]).hexdigest() for img in ds.cast_column("image", Image(decode=False))["image"]]


def summarize(m, *, n_boot: int, seed: int) -> dict:
    """``summarize_reliance``'s tables of a measurement, compacted, with its per-rollout records beside them."""
    from trl_mdi.profile.reliance_report import summarize_reliance

    return {**compact_summary(summarize_reliance(m, n_boot=n_boot, seed=seed), m),
            "records": rollout_records(m), "n_boot": n_boot, "seed": seed}


def rollout_records(m) -> dict:
    """What the statistics are computed from, kept so that they can be recomputed (another bootstrap, another
    signal set, a within-prompt statistic added later) without measuring again: the measured rows (``prompts``:
    gold, prior, conflict flag, greedy answer and blind answer per kind) and every scored rollout (``rollouts``:
    its prompt index into ``prompts``, sample number, completion, answer, MDI values and per kind every
    counterfactual signal), as ``measure_reliance`` returned them (NaN written as null); the data's label of a
    rollout follows from its answer and its prompt (``data_prior_label``). :func:`recompute` reads them back."""
    return _clean({"kinds": list(m.kinds), "samples": m.samples, "seconds": m.seconds, "data_labels": m.data_labels,
                   "skipped": {str(k): v for k, v in m.skipped.items()}, "prompts": m.prompts,
                   "rollouts": m.rollouts})


def recompute(summary: dict, *, n_boot: int | None = None, seed: int | None = None) -> dict:
    """:func:`summarize` again from a stored summary's ``records`` (the same ``n_boot`` and ``seed`` unless given):
    the tables a current ``summarize_reliance`` makes of the same rollouts."""
    from trl_mdi.profile.reference import RelianceMeasurement

    rec = summary.get("records")
    if not rec:
        raise ValueError("this reliance summary has no per-rollout records (measured before they were stored): "
                         "rerun its job to recompute its statistics")

    def nan(x):
        if x is None:
            return math.nan
        if isinstance(x, dict):
            return {k: nan(v) for k, v in x.items()}
        return x

    rollouts = [{k: (nan(v) if k == "signals" or k.startswith("mdi") else v) for k, v in r.items()}
                for r in rec["rollouts"]]
    m = RelianceMeasurement(kinds=rec["kinds"], prompts=rec["prompts"], rollouts=rollouts,
                            skipped={int(k): v for k, v in rec["skipped"].items()}, samples=rec["samples"],
                            seconds=rec["seconds"], data_labels=rec["data_labels"])
    return summarize(m, n_boot=summary.get("n_boot", 1000) if n_boot is None else n_boot,
                     seed=summary.get("seed", 0) if seed is None else seed)


def _clean(x):
    """JSON-ready: NaN -> None, recursively."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def compact_summary(summary: dict, m) -> dict:
    """What the report keeps of ``summarize_reliance``'s summary: counts, seconds, the kind-independent signals'
    means and, per kind, the accuracies, the signal means, the AUROC table against the data's label (every signal
    ``summarize_reliance`` scored, by name: pooled and within-prompt AUROC with prompt-bootstrap intervals, on the
    rollouts where every one of them is defined, ``n_defined`` before that) and the rule's agreement with it; plus
    the rollout count per class."""
    kinds = {}
    for kind, k in summary["kinds"].items():
        table = {r["signal"]: r for r in (k["data_table"] or [])}
        kinds[kind] = {"accuracy_image": k["accuracy_image"], "accuracy_counterfactual": k["accuracy_counterfactual"],
                       "same_answer_rate": k["same_answer_rate"], "means": k["means"], "table": table,
                       "agreement": k["agreement"]}
    return _clean({"prompts": summary["rows"], "rollouts": summary["rollouts"], "samples": m.samples,
                   "seconds": round(m.seconds, 2), "labelled": summary["data_labels"],
                   "attention_means": summary["attention_means"], "kinds": kinds})
