"""benchmarks/language_prior.py's held-out evaluation: accuracy on conflict and non-conflict rows, and MDI."""

from __future__ import annotations

from trl_mdi.evaluation import score_completions
from trl_mdi.warmup import WarmupRecipe, evaluate_accuracy, synthetic_dataset


class HeldOut:
    """The held-out rows (with images and blank) and scoring split by conflict / non-conflict rows."""

    def __init__(self, s, recipe: WarmupRecipe):
        data = dict(split="validation", seed=recipe.data_seed, kinds=recipe.kinds, option_order=recipe.option_order,
                    image_size=recipe.image_size, conflict_rate=s.eval_conflict_rate)
        self.ds = synthetic_dataset(s.n_eval, **data)
        self.blank = synthetic_dataset(s.n_eval, blank_images=True, **data)
        self.s = s
        flags = self.ds["conflict"]
        self.rows = {"conflict": [i for i, c in enumerate(flags) if c], "plain": [i for i, c in enumerate(flags) if not c]}
        self.labels, self.prior = self.ds["label_idx"], self.ds["prior_idx"]

    def evaluate(self, model, processor, *, blank: bool = False) -> dict:
        """Greedy accuracy on conflict / non-conflict rows, how often conflict rows got the prior's answer, and
        the mean MDI (all layers, late segment) of the greedy answers."""
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
