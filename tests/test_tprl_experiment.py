"""The TPRL experiment on look_or_guess_long (issue 44, benchmarks/tprl_*.py): every GRPO setting written out, the
arms, the keys a finished run is found by, the development figures on hand-made rollouts, and the results report
(below the plan's closing line, never the plan) on hand-made records. No training here: the runs are the benchmark's."""

from __future__ import annotations

import dataclasses
import doctest
import json

import pytest

from benchmarks import tprl_design as D
from benchmarks import tprl_report as R


def test_every_grpo_setting_is_the_experiments_not_a_library_default(tmp_path):
    # Values no library default has: each must reach the config, so a changed default cannot change a run.
    s = D.TprlSettings(epsilon=0.17, epsilon_high=0.31, beta=0.001, mask_truncated_completions=False,
                       scale_rewards="batch", loss_type="grpo", num_iterations=2, top_entropy_quantile=0.9,
                       max_grad_norm=0.7, learning_rate=2e-4, perturbation="grayscale", attention_segment="middle")
    for name, arm in D.ARMS.items():
        c = D.grpo_config(arm, 5, s, tmp_path / name)
        for field in ("loss_type", "epsilon", "epsilon_high", "beta", "scale_rewards", "num_iterations",
                      "mask_truncated_completions", "top_entropy_quantile", "max_grad_norm", "learning_rate",
                      "multi_objective_aggregation", "importance_sampling_level", "temperature", "top_p", "top_k",
                      "repetition_penalty", "weight_decay", "warmup_steps", "steps_per_generation",
                      "gradient_accumulation_steps", "shuffle_dataset", "disable_dropout", "adam_beta1",
                      "adam_beta2", "adam_epsilon"):
            assert getattr(c, field) == getattr(s, field), (name, field)
        assert c.seed == 5 and c.max_steps == s.steps and c.num_generations == 8
        assert c.per_device_train_batch_size == s.prompts_per_step * s.num_generations
        assert c.reward_weights[-2:] == [0.0, 0.0]  # the style loggers change no advantage
        assert c.reward_funcs[-2:] == ["fixtures.synthetic.look_or_guess:long_look_rate",
                                       "fixtures.synthetic.look_or_guess:long_guess_rate"]
        assert not c.reliance_signals and c.compute_attention_metrics
        assert c.uses_tprl == (arm.tprl is not None)
    t, t_att, p, m = (D.grpo_config(D.ARMS[x], 0, s, tmp_path / x) for x in ("T", "T_att", "P", "M"))
    for c in (t, t_att, p):
        assert (c.enable_entropy_filtering, c.enable_perception_filtering, c.enable_trajectory_reweighting) == (
            True, True, True)
        assert (c.top_p_entropy_tokens, c.top_p_perception_tokens, c.trajectory_scaling_min) == (0.2, 0.2, 0.8)
        assert c.perception_perturbation == "grayscale" and c.perception_attention_segment == "middle"
    assert (t.perception_signal, t_att.perception_signal, p.perception_signal) == ("perturbation", "attention",
                                                                                   "perturbation")
    assert (t.tprl_placebo, t_att.tprl_placebo, p.tprl_placebo) == (False, False, True)
    assert m.reward_funcs[:3] == ["mc_idx", "think_format", "mdi_balance"] and m.reward_weights[:3] == [4, 1, 1]
    assert not m.uses_tprl


def test_a_run_is_keyed_by_its_environment_and_warmup():
    s, arm = D.TprlSettings(), D.ARMS["T"]
    env = {"float_path": "pinned", "libraries": {"torch": "2.14.1"}}
    key = D.run_key(s, arm, 200, env, "ab" * 32)
    assert key == D.run_key(s, arm, 200, dict(env), "ab" * 32)
    assert key != D.run_key(s, arm, 200, {**env, "float_path": "native"}, "ab" * 32)
    assert key != D.run_key(s, arm, 200, env, "cd" * 32)
    assert key != D.run_key(dataclasses.replace(s, steps=s.steps + 1), arm, 200, env, "ab" * 32)
    assert key != D.run_key(s, D.ARMS["P"], 200, env, "ab" * 32)
    assert s.n_pool == s.steps * s.prompts_per_step and s.mid_step == s.steps // 2


def test_the_design_modules_doctests():
    from benchmarks import environment, tprl_runs

    for module in (D, environment, tprl_runs, R):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ------------------------------------------------------------------------------------ development figures


def _rollout(prompt, style, s_colour, entropy_branch, tok, conflict=False):
    from fixtures.synthetic.look_or_guess import long_style_target

    colour = "red" if style == "look" else "blue"
    text = long_style_target(style, "sky", colour, ["red", "green", "blue", "yellow"])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = len(ids)
    r = {"prompt": prompt, "style": style, "conflict": conflict, "text": text, "ids": ids,
         "entropy": [0.01] * n, "s": {"k": [0.0] * n}, "a": {"late": [0.1] * n}}
    from benchmarks.tprl_dev import decision_positions

    pos = decision_positions(r, tok)
    r["s"]["k"][pos["colour"]] = s_colour
    r["entropy"][pos["branch"]] = entropy_branch
    r["a"]["late"][pos["colour"]] = 0.05 if style == "look" else 0.5  # attention ranks the styles backwards
    return r


def test_development_figures_on_hand_made_rollouts():
    from benchmarks.tprl_dev import decision_positions, signal_tables
    from fixtures.tiny import build_tiny_vlm
    from fixtures.warmup import DEFAULT_MODEL_SIZE

    _, processor = build_tiny_vlm("qwen2_vl", seed=0, **DEFAULT_MODEL_SIZE)
    tok = processor.tokenizer
    rs = []
    for p in range(3):
        rs += [_rollout(p, "look", 2.0 + p, 0.7, tok), _rollout(p, "look", 1.5, 0.69, tok),
               _rollout(p, "guess", 0.01, 0.7, tok), _rollout(p, "guess", 0.0, 0.68, tok)]
    pos = decision_positions(rs[0], tok)
    assert tok.decode([rs[0]["ids"][pos["branch"]]]) == " image" and tok.decode([rs[0]["ids"][pos["colour"]]]) == " red"
    t = signal_tables(rs, tok, n_boot=0)
    assert t["kinds"]["k"]["all"]["auroc"] == 1.0 and t["kinds"]["k"]["all"]["pairs"] == 12
    assert t["kinds"]["k"]["colour_kept_look"] == 1.0  # the colour word is the top token by s_t
    assert t["segments"]["late"]["all"]["auroc"] == 0.0  # backwards, as the late layers were on the short task
    branch = t["positions"]["branch"]
    assert branch["look"]["entropy_kept"] == 1.0 and branch["look"]["s"]["k"] == 0.0  # kept by entropy only
    assert branch["look"]["token"] == " image" and branch["guess"]["token"] == " "
    assert D.pick_by_auroc({"k": 1.0, "j": 0.5}, ("j", "k"))[0] == "k"


# ------------------------------------------------------------------------------------ the results report


PLAN = (f"# Benchmark results\n\n## Earlier\n\ntext\n\n{R.SECTION}\n\nThe plan, word for word.\n\n{R.PLAN_END}\n\n"
        "### Results\n\nold results\n\n## Later section\n\nkept\n")


def test_results_go_below_the_plan_and_nowhere_else(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(PLAN)
    R.write_results(path, "\n### Results\n\nnew results\n")
    text = path.read_text()
    assert text.startswith(PLAN[:PLAN.index(R.PLAN_END) + len(R.PLAN_END)])  # the plan, byte for byte
    assert "new results" in text and "old results" not in text and text.endswith("## Later section\n\nkept\n")
    R.write_results(path, "\n### Results\n\nnewer\n")
    assert path.read_text().count("### Results") == 1
    path.write_text("# Benchmark results\n\n## Earlier\n")
    with pytest.raises(ValueError, match="no pre-registered TPRL plan"):
        R.write_results(path, "x")


def _records():
    base = [0.45, 0.50, 0.55, 0.48, 0.52, 0.47, 0.53, 0.50, 0.44, 0.56, 0.49, 0.51, 0.46, 0.54, 0.50, 0.52]
    shift = {"A": 0.0, "T": 0.2, "T_att": 0.0, "P": 0.01, "M": -0.25}
    wiggle = {"A": 0.0, "T": 0.03, "T_att": 0.04, "P": 0.02, "M": 0.03}
    s = dataclasses.asdict(D.TprlSettings(steps=4))
    s.update(n_pool=16, mid_step=2)
    runs = []
    for arm in D.ARM_NAMES:
        for i, b in enumerate(base):
            c = b + shift[arm] + wiggle[arm] * ((i % 3) - 1)
            final = {"conflict": c, "plain": 0.95, "clean": 0.93, "neither": 0.1, "guess": 0.3 - shift[arm] / 2,
                     "look": 0.5 + shift[arm] / 2}
            # 40 conflict rollouts: 10 neither-style ones, right on 8 (A) or 4 (the others) of them
            other = {"n": 10, "accuracy": 0.8 if arm == "A" else 0.4}
            sampled = {"conflict": {"n": 40, "look": {"n": 20, "accuracy": 0.9}, "guess": {"n": 10, "accuracy": 0.1},
                                    "other": other}}
            runs.append({"arm": arm, "seed": 200 + i, "final": final, "mid": {"outcomes": {**final, "conflict": c - 0.1}},
                         "eval": {"sampled": sampled},
                         "steps": [{"rewards/long_look_rate/mean": 0.4 + 0.05 * k + shift[arm]} for k in range(4)],
                         "settings": s, "warmup_sha256": "ab" * 32, "wall_seconds": 300.0, "cpu_seconds": 300.0,
                         "started_at": 0.0, "ended_at": 600.0, "code": {"commit": "abcdef1234567890", "dirty": False},
                         "environment": {"float_path": "pinned", "torch_cpu_capability": "AVX2",
                                         "cpu": {"model": "AMD EPYC"}, "variables": {"MKL_CBWR": "COMPATIBLE"},
                                         "torch_threads": 1, "python": "3.11.7",
                                         "libraries": {"torch": "2.14.1"}}})
    return runs


def test_the_report_from_hand_made_records(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(PLAN)
    body = R.report(_records(), path, sims=50)
    assert "**T: + TPRL (perturbation): shown: helps**" in body
    assert "**M: + mdi_balance (4:1:1): shown: harms**" in body
    assert "**T_att: + TPRL (attention): refuted: too small**" in body
    assert "| T vs P | +0.189 [" in body  # the placebo comparison
    assert "80 runs (A 16, T 16, T_att 16, P 16, M 16)" in body and "nothing was cut from the plan" in body
    assert "`abababababababab` (80 runs)" in body and "CPU AMD EPYC; float path pinned (torch AVX2" in body
    assert "| A | 0.40 | 0.45 | 0.50 | 0.55 |" in body  # the learning curve, one window per step here
    assert "| 215 |" in body  # per seed
    assert "Power (simulated" in body
    # every hand-made run spans [0, 600] s and used 300 CPU seconds
    assert "0.2 h of the machine on 2 workers, in 1 sitting(s)" in body and "A 5.0 min" in body
    # what the neither-style chains answer (descriptive): share 10/40, accuracy per arm
    assert "| A | 0.500 ± 0.000 | 0.900 ± 0.000 | 0.250 ± 0.000 | 0.100 ± 0.000 | 0.250 ± 0.000 | 0.800 ± 0.000 |" \
        in body
    assert "| M | 0.500 ± 0.000 | 0.900 ± 0.000 | 0.250 ± 0.000 | 0.100 ± 0.000 | 0.250 ± 0.000 | 0.400 ± 0.000 |" \
        in body
    assert "What each style answers" in body
    bare = [{k: v for k, v in r.items() if k != "eval"} for r in _records()]
    assert "What each style answers" not in R.report(bare, path, sims=10)  # records without evaluations: no table
    rows = [line for line in body.splitlines() if line.startswith("| M vs A |")]
    assert rows and "shown: lower" in rows[0]
    R.write_results(path, body)
    assert json.dumps(body)  # plain text


# ------------------------------------------------------------------------------------------------ the committed plan
def _plan() -> str:
    from benchmarks.results import RESULTS

    text = RESULTS.read_text(encoding="utf-8")
    assert R.SECTION in text and R.PLAN_END in text, "the pre-registered TPRL plan is missing from RESULTS.md"
    return text[text.index(R.SECTION):text.index(R.PLAN_END) + len(R.PLAN_END)]


def _plan_command():
    """The plan's reproduce command, parsed by the experiment's own parser."""
    import re
    import shlex

    from benchmarks import tprl_look_or_guess as E

    command = re.search(r"\*\*Reproduce\*\*: `python -m benchmarks\.tprl_look_or_guess (experiment[^`]*)`",
                        _plan().replace("\n", " "))
    assert command is not None, "the plan's reproduce command is missing"
    return E.parse_args(shlex.split(command.group(1)))


def test_the_committed_plan_is_the_plan_commits_text_word_for_word():
    """The plan in RESULTS.md is the text of the commit that added it: results go below its closing line only."""
    import subprocess

    from benchmarks.results import RESULTS

    commit = R.plan_commit(RESULTS)
    if commit is None:
        pytest.skip("no git history here (the plan commit cannot be read)")
    then = subprocess.run(["git", "show", f"{commit}:benchmarks/RESULTS.md"], cwd=RESULTS.parent, capture_output=True,
                          text=True, check=True).stdout
    assert R.SECTION in then
    assert _plan() == then[then.index(R.SECTION):then.index(R.PLAN_END) + len(R.PLAN_END)]


def test_the_plans_command_runs_the_development_records_choices():
    """The plan's reproduce command, parsed by the experiment's own parser, carries what the committed development
    record chose (rules D0-D5) and the seeds the plan names; the record is the one the summary was written from."""

    from benchmarks.results import RESULTS

    dev = json.loads((RESULTS.parent / "tprl_dev_record.json").read_text(encoding="utf-8"))
    a = _plan_command()
    assert a.learning_rate == dev["learning_rate"]["chosen"]
    assert a.steps == dev["steps"]["chosen"]
    assert a.pool_conflict_rate == float(dev["rate"]["chosen"])
    assert (a.perturbation, a.attention_segment) == (dev["signals"]["perturbation"], dev["signals"]["segment"])
    assert a.warmup_epochs == dev["warmup"]["chosen_epochs"]
    assert dev["warmup"]["sha256"].startswith(a.warmup_sha256) and dev["warmup"]["sha256"] in _plan()
    assert a.seeds == list(range(300, 316)) and sorted(a.arms) == sorted(D.ARMS)
    summary = (RESULTS.parent / "tprl_dev_summary.md").read_text(encoding="utf-8")
    assert f"**Chosen: {dev['warmup']['chosen_epochs']:g} epochs, weights sha256 `{dev['warmup']['sha256']}`.**" \
        in summary


def test_the_committed_run_records_are_the_plans_runs():
    """Every record in ``benchmarks/tprl_records/`` (the plan's finished runs, gzipped, committed as they finish) is
    a run of the plan: an arm and seed it names, from a clean checkout of the plan commit, the plan's warm-up, the
    pinned float path, and a key that the plan's own command gives for that arm, seed and environment (a record
    from other settings, code or environment would be rerun by ``experiment``, so it cannot stand here)."""
    import gzip

    from benchmarks.environment import PINNED, environment_key
    from benchmarks.results import RESULTS

    paths = sorted((RESULTS.parent / "tprl_records").glob("*.json.gz"))
    if not paths:
        pytest.skip("no run record committed yet")
    a = _plan_command()
    s = D.TprlSettings(steps=a.steps, pool_conflict_rate=a.pool_conflict_rate, learning_rate=a.learning_rate,
                       perturbation=a.perturbation, attention_segment=a.attention_segment, eval_split="test")
    commit = R.plan_commit(RESULTS)
    for path in paths:
        rec = json.loads(gzip.decompress(path.read_bytes()))
        name = path.name.removesuffix(".json.gz")
        assert name == f"{rec['arm']}-s{rec['seed']}" == rec["label"], path.name
        assert rec["arm"] in D.ARMS and rec["seed"] in a.seeds, name
        assert not rec["code"].get("dirty"), (name, rec["code"])
        if commit is not None:
            assert rec["code"]["commit"].startswith(commit), (name, rec["code"]["commit"], commit)
        assert rec["warmup_sha256"].startswith(a.warmup_sha256), name
        assert rec["environment"]["float_path"] == PINNED, name
        assert rec["settings"] == D.settings_dict(s), name
        assert rec["key"] == D.run_key(s, D.ARMS[rec["arm"]], rec["seed"], environment_key(rec["environment"]),
                                       rec["warmup_sha256"]), name
        assert rec.get("final") and 0.0 <= rec["final"]["conflict"] <= 1.0, name
