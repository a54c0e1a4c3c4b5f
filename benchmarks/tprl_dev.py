"""TPRL on look or guess with conflict rows (issue 44): what the development split measures on the warm-up's own
rollouts, for rules D2 and D3 of ``benchmarks.tprl_design`` (TPRL's perturbation, the attention signal's segment),
and where the chains decide.

Per rollout, teacher-forced on its sampled tokens with plain no-grad forwards laid out as the trainer lays them out
(``trl_mdi.batch.policy_batch``; ``trl_mdi.profile.reference.completion_logits``): the log-probs and entropies with
the real image, s_t under each candidate perturbation (``trl_mdi.tprl.perturbation_signal``, the perturbed prompt
from ``trl_mdi.counterfactual.counterfactual_prompts``, drawn per rollout as the trainer draws it), and a_t per layer
segment (the probe's ``attention_signal``). Then per candidate the trajectory score S_i = mean_t over the completion,
and its within-prompt AUROC for look against guess (``trl_mdi.profile.validation.within_prompt_auroc``; prompts
resampled for the interval): what TAS's multipliers follow inside a GRPO group.

Where the chains decide: the branching token (the word after " I use the": where the style is chosen) and the
colour word of the style sentence (``fixtures.synthetic.look_or_guess.long_style_spans``), with s_t, the entropy and
a_t there, and how often TGF's filters (``top_p_token_mask`` at the arms' 0.2) keep each.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, defaultdict

import torch

from benchmarks.look_or_guess_task import label_rollouts, sample_rollouts, style_metrics
from benchmarks.tprl_design import PERTURBATION_CANDIDATES, SEGMENT_CANDIDATES, TprlSettings, pick_by_auroc
from fixtures.synthetic.look_or_guess import GUESS, LOOK, LOOK_OR_GUESS_LONG, long_style_spans


@torch.no_grad()
def token_signals(model, processor, ds, rollouts: list[dict], kinds=PERTURBATION_CANDIDATES,
                  segments=SEGMENT_CANDIDATES, *, s: TprlSettings, seed: int = 0, batch_size: int = 32) -> None:
    """Add to each rollout (``sample_rollouts``' dicts; ``ids`` up to and including the end token) its per-token
    ``logps`` and ``entropy`` with the real image, ``s`` (kind -> s_t) and ``a`` (segment -> a_t), as lists over its
    tokens. Rollout j of the list draws its perturbation as row j at step 0 of ``seed``."""
    from trl.data_utils import prepare_multimodal_messages

    from trl_mdi.attention import measure_modality_attention
    from trl_mdi.batch import encode_prompts, policy_batch
    from trl_mdi.counterfactual import counterfactual_prompts
    from trl_mdi.profile.reference import completion_logits
    from trl_mdi.tprl import perturbation_signal

    tok = processor.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    try:
        for lo in range(0, len(rollouts), batch_size):
            chunk = [r for r in rollouts[lo:lo + batch_size]]
            rows = [ds[r["prompt"]] for r in chunk]
            images = [[row["image"]] for row in rows]
            prompts = [prepare_multimodal_messages(row["prompt"], images=imgs) for row, imgs in zip(rows, images)]
            completions = [r["ids"] or [pad] for r in chunk]

            def layout(ps, completions=completions):
                prompt_ids, fields = encode_prompts(processor, ps)
                return policy_batch(prompt_ids, completions, pad_token_id=pad, multimodal=fields, device=model.device)

            batch = layout(prompts)
            logits, logps = completion_logits(model, batch)
            logp_all = logits.log_softmax(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            per_kind = {}
            for kind in kinds:
                cf = counterfactual_prompts(prompts, images, kind, seed=seed, step=0, row_offset=lo,
                                            patch_size=s.perturbation_patch_size, prob=s.perturbation_prob)
                _, cf_logps = completion_logits(model, layout(cf))
                per_kind[kind] = perturbation_signal(logps, cf_logps)
            per_segment = {}
            for seg in segments:
                result = measure_modality_attention(model, **batch.probe_inputs(), token_segment=seg,
                                                    segments="thirds")
                per_segment[seg] = result.attention_signal(batch.logits_to_keep).float()
            for j, r in enumerate(chunk):
                n = len(r["ids"])
                r["logps"] = [round(float(x), 5) for x in logps[j, :n]]
                r["entropy"] = [round(float(x), 5) for x in entropy[j, :n]]
                r["s"] = {k: [round(float(x), 6) for x in v[j, :n]] for k, v in per_kind.items()}
                r["a"] = {k: [round(float(x), 6) for x in v[j, :n]] for k, v in per_segment.items()}
    finally:
        model.train(was_training)


def decision_positions(rollout: dict, tokenizer) -> dict[str, int] | None:
    """The token indices of the branching token and the colour word of a rollout in either long style (the token
    whose text holds the first character of ``long_style_spans``' span); None in neither style, or where the tokens'
    texts do not spell the rollout's text."""
    spans = long_style_spans(rollout["text"])
    if spans is None:
        return None
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in rollout["ids"]]
    if "".join(pieces) != rollout["text"]:
        return None
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    out = {}
    for name, (a, _) in spans.items():
        out[name] = max(i for i, st in enumerate(starts) if st <= a and len(pieces[i]) > 0)
    return out


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def signal_tables(rollouts: list[dict], tokenizer, *, top_p: float = 0.2, n_boot: int = 1000) -> dict:
    """D2's and D3's figures from scored rollouts (:func:`token_signals`): per perturbation ``kinds[k]``: the
    within-prompt AUROC of S_i = mean s_t for look against guess (all rows, conflict rows, non-conflict rows; with its
    prompt-bootstrap interval on all rows), the share of look rollouts whose colour word the perception filter
    keeps (top ``top_p`` of s_t), and mean S_i per style; per segment the same AUROC of mean a_t; per decision
    position (branch, colour) and style the mean s_t of each kind, entropy, a_t, and the share each filter keeps."""
    from trl_mdi.profile.validation import within_prompt_auroc
    from trl_mdi.tprl import top_p_token_mask

    styled = [r for r in rollouts if r["style"] in (LOOK, GUESS) and "s" in r]
    for r in styled:
        r["positions"] = decision_positions(r, tokenizer)
    labels = [1 if r["style"] == LOOK else 0 for r in styled]
    prompts = [r["prompt"] for r in styled]
    kinds = list(styled[0]["s"]) if styled else []
    segments = list(styled[0]["a"]) if styled else []

    def auroc(values: list[float], subset=None, boot: int = 0) -> dict:
        idx = [i for i in range(len(styled)) if subset is None or styled[i]["conflict"] == subset]
        d = within_prompt_auroc([values[i] for i in idx], [labels[i] for i in idx], [prompts[i] for i in idx],
                                direction="high", n_boot=boot)
        return {k: d.get(k) for k in ("auroc", "low", "high", "pairs", "prompts")}

    def kept(scores: list[float], at: int) -> bool:
        m = top_p_token_mask(torch.tensor([scores], dtype=torch.float64), torch.ones(1, len(scores)), top_p)
        return bool(m[0, at])

    out: dict = {"rollouts": len(rollouts), "styled": len(styled), "look": sum(labels),
                 "guess": len(labels) - sum(labels), "kinds": {}, "segments": {}, "positions": {}}
    for kind in kinds:
        S = [statistics.fmean(r["s"][kind]) for r in styled]
        look_col = [kept(r["s"][kind], r["positions"]["colour"]) for r in styled
                    if r["style"] == LOOK and r["positions"]]
        out["kinds"][kind] = {"all": auroc(S, boot=n_boot), "conflict": auroc(S, True), "plain": auroc(S, False),
                              "colour_kept_look": _mean(look_col),
                              "S_look": _mean(S[i] for i in range(len(S)) if labels[i]),
                              "S_guess": _mean(S[i] for i in range(len(S)) if not labels[i])}
    for seg in segments:
        A = [statistics.fmean(r["a"][seg]) for r in styled]
        out["segments"][seg] = {"all": auroc(A, boot=n_boot), "conflict": auroc(A, True), "plain": auroc(A, False),
                                "A_look": _mean(A[i] for i in range(len(A)) if labels[i]),
                                "A_guess": _mean(A[i] for i in range(len(A)) if not labels[i])}
    for where in ("branch", "colour"):
        table = {}
        for style in (LOOK, GUESS):
            rs = [r for r in styled if r["style"] == style and r["positions"]]
            cell: dict = {"n": len(rs)}
            if rs:
                cell["entropy"] = _mean(r["entropy"][r["positions"][where]] for r in rs)
                cell["entropy_kept"] = _mean(kept(r["entropy"], r["positions"][where]) for r in rs)
                cell["s"] = {k: _mean(r["s"][k][r["positions"][where]] for r in rs) for k in kinds}
                cell["s_kept"] = {k: _mean(kept(r["s"][k], r["positions"][where]) for r in rs) for k in kinds}
                cell["a"] = {g: _mean(r["a"][g][r["positions"][where]] for r in rs) for g in segments}
                cell["token"] = Counter(tokenizer.decode([r["ids"][r["positions"][where]]])
                                        for r in rs).most_common(1)[0][0]
            table[style] = cell
        out["positions"][where] = table
    # Every other position, for scale: the mean entropy and s_t over the tokens that are neither.
    rest_entropy = defaultdict(list)
    for r in styled:
        if not r["positions"]:
            continue
        skip = set(r["positions"].values())
        rest_entropy[r["style"]] += [e for i, e in enumerate(r["entropy"]) if i not in skip]
    out["positions"]["elsewhere_entropy"] = {k: _mean(v) for k, v in rest_entropy.items()}
    return out


def develop_signals(model, processor, ds, s: TprlSettings, *, samples: int = 8, log=print, n_boot: int = 1000) -> dict:
    """D2 and D3 on the warm-up: ``samples`` rollouts per development prompt at temperature 1, labelled from their
    text, scored (:func:`token_signals`), tabled (:func:`signal_tables`); the perturbation and the segment chosen by
    ``tprl_design.pick_by_auroc``. Returns the tables, the choices with their reasons, and the rollouts' style
    figures."""
    start = time.perf_counter()
    rollouts = sample_rollouts(model, processor, ds, samples=samples, max_new_tokens=s.max_completion_length, seed=0,
                               greedy=False)
    label_rollouts(rollouts, ds, LOOK_OR_GUESS_LONG)
    log(f"  dev signals: {len(rollouts)} rollouts sampled ({time.perf_counter() - start:.0f} s); scoring per token")
    token_signals(model, processor, ds, rollouts, s=s)
    tables = signal_tables(rollouts, processor.tokenizer, top_p=s.top_p_perception_tokens, n_boot=n_boot)
    kinds = tables["kinds"]
    perturbation, why_p = pick_by_auroc({k: v["all"]["auroc"] for k, v in kinds.items()}, PERTURBATION_CANDIDATES,
                                        second={k: v["colour_kept_look"] for k, v in kinds.items()})
    segment, why_s = pick_by_auroc({k: v["all"]["auroc"] for k, v in tables["segments"].items()}, SEGMENT_CANDIDATES)
    m = style_metrics(rollouts)
    log(f"  dev signals: perturbation {perturbation} ({why_p}); segment {segment} ({why_s})")
    return {"tables": tables, "perturbation": perturbation, "why_perturbation": why_p, "segment": segment,
            "why_segment": why_s, "rollouts": len(rollouts), "prompts": len(ds), "samples": samples,
            "look_rate": m["all"]["look_rate"], "other_rate": m["all"]["other_rate"], "both_styles": m["both_styles"],
            "seconds": round(time.perf_counter() - start, 1)}
