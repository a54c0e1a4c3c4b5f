"""The smaller bad inputs of issue 42 (item 7), each one line before anything loads:

- a prompt longer than the model's positions (100,000-character questions passed the dry run, then the run showed no
  progress for minutes), counted as TRL's prompt encoding counts it, image tokens included;
- a key given twice in the ``--config`` YAML (the last value won, silently);
- a model folder without processor files, a directory given as a log path, a binary ``--question_id_file``
  (tracebacks before).

The checkpoint "cut short" wording (a file that grew) is tested in test_faults.py.
"""

from __future__ import annotations

import io

import datasets
import pytest
from PIL import Image

from trl_mdi.cli.command import main

datasets.disable_progress_bars()


def png(size=(56, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def write_rows(folder, prompts, sizes=None):
    folder.mkdir(parents=True, exist_ok=True)
    n = len(prompts)
    sizes = sizes or [[(56, 48)]] * n
    rows = {"images": [[{"bytes": png(s), "path": None} for s in row] for row in sizes], "prompt": prompts,
            "label_idx": [0] * n, "choices": [["red", "blue"]] * n, "question_id": [f"q{i}" for i in range(n)]}
    datasets.Dataset.from_dict(rows).to_parquet(folder / "train.parquet")
    return folder


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------------------------ long prompts
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "idefics3", "llava", "internvl", "mistral3", "gemma3", "glm4v"])
def test_prompt_lengths_count_what_trls_prompt_encoding_gives(arch):
    """The count the length check uses equals the length of the prompt ids TRL's encoding gives (the chat template,
    images inserted as TRL inserts them, each placeholder expanded by the processor), for rows of 0, 1 and 2 images of
    different sizes, on families whose image tokens are counted differently (markers, tiles, fixed squares)."""
    from trl.data_utils import prepare_multimodal_messages

    from fixtures.tiny import build_tiny_vlm
    from trl_mdi.data.images import ProcessorImageCheck
    from trl_mdi.data.lengths import prompt_lengths

    _, processor = build_tiny_vlm(arch)
    prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What colour? " * k}]
               for k in (1, 5, 40)]
    sizes = [[(56, 48)], [(90, 40), (28, 28)], []] if arch not in ("gemma3", "mistral3") else [[(56, 48)], [(90, 40)],
                                                                                                 []]
    counted = prompt_lengths(prompts, sizes, processor, ProcessorImageCheck(processor))
    actual = []
    for prompt, row_sizes in zip(prompts, sizes):
        images = [Image.new("RGB", s) for s in row_sizes]
        conversation = prepare_multimodal_messages(prompt, images=images)
        encoded = processor.apply_chat_template([conversation], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        actual.append(len(encoded["input_ids"][0]))
    assert counted == actual


def test_a_prompt_longer_than_the_models_positions_is_one_line_at_load(capsys, tiny_vlm_dir, tmp_path):
    data = write_rows(tmp_path / "data", ["What colour?\nA. red\nB. blue", "What colour? " + "very " * 20000,
                                          "What colour?", "Which?"])
    code, out, err = run(capsys, "--model_name_or_path", tiny_vlm_dir("qwen2_5_vl"), "--dataset_path", data,
                         "--output_dir", tmp_path / "out", "--dry_run", "--max_completion_length", "64")
    lines = [line for line in err.splitlines() if "error" in line]  # the fixture may print its model build
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: split 'train': 1 prompt(s) too long for the model: question_id 'q1' (")
    assert "--max_completion_length 64 must fit the model's 8192 positions together, which leaves a prompt 8128 " \
           "tokens" in lines[0]


# ---------------------------------------------------------------------------------------------------- the rest
def test_a_yaml_key_given_twice_is_one_line(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("max_steps: 3\nlearning_rate: 1.0e-6\nmax_steps: 5\nmodel_init_kwargs:\n  dtype: float32\n"
                      "  dtype: bfloat16\n")
    code, _, err = run(capsys, "--config", config, "--output_dir", tmp_path / "out")
    assert code == 2 and err.strip() == (
        f"error: --config {str(config)!r} sets a key twice ('max_steps' on lines 1 and 3; 'dtype' on lines 5 and 6): "
        "YAML would silently keep the last value. Keep one line per key."), err


def test_a_model_folder_without_processor_files_is_one_line(capsys, tiny_vlm_dir, prepared_aokvqa_dir, tmp_path):
    import shutil

    folder = tmp_path / "weights_only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_vlm_dir("qwen2_5_vl") / name, folder / name)
    code, _, err = run(capsys, "--model_name_or_path", folder, "--dataset_path", prepared_aokvqa_dir, "--output_dir",
                       tmp_path / "out", "--dry_run")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: cannot load the processor of {str(folder)!r} (OSError: ")
    assert "the folder holds config.json, model.safetensors" in err and "processor_config.json" in err


@pytest.mark.parametrize("flag", ["--attention_diag_log_path", "--rollout_log_path"])
def test_a_directory_given_as_a_log_path_is_one_line_before_the_model_loads(capsys, tiny_vlm_dir, prepared_aokvqa_dir,
                                                                             tmp_path, flag):
    (tmp_path / "logs").mkdir()
    code, _, err = run(capsys, "--model_name_or_path", tiny_vlm_dir("qwen2_5_vl"), "--dataset_path",
                       prepared_aokvqa_dir, "--output_dir", tmp_path / "out", "--dry_run", flag, tmp_path / "logs")
    assert code == 2 and err.strip() == (
        f"error: {flag} {str(tmp_path / 'logs')!r}: it is a directory. Valid example: {flag} training_logs/my_run.md "
        "(a file path; its folder is created)"), err


def test_a_binary_question_id_file_is_one_line(capsys, tmp_path):
    from data_prep.prepare_aokvqa_for_trl import main as prep_main
    from fixtures.synthetic import write_synthetic_aokvqa

    write_synthetic_aokvqa(str(tmp_path / "src"), n_train=4, n_validation=2, n_test=0, seed=0, num_shards=1)
    ids = tmp_path / "ids.parquet"
    ids.write_bytes(b"PAR1\x15\x04\xff\xd0\x00binary")
    assert prep_main(["--dataset_path", str(tmp_path / "src"), "--out_dir", str(tmp_path / "out"),
                      "--question_id_file", str(ids)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"error: question_id_file {str(ids)!r} is not a text file (byte ff at offset 6 is not "
                           "UTF-8): give a text file of question ids, one per line"), err
