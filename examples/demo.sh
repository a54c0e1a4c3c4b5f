#!/usr/bin/env bash
# `make demo`: the main job on the embedded default, offline, on CPU.
#   1. build a tiny Qwen2.5-VL (real classes, random weights, locally trained tokenizer)
#   2. write synthetic A-OKVQA-format data (colour / shape / count questions that need the image)
#   3. convert it with data_prep/prepare_aokvqa_for_trl.py, exactly as for the real dataset
set -euo pipefail
OUT="${1:-demo_run}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"

echo "== 1/3 tiny Qwen2.5-VL -> $OUT/tiny-qwen2_5_vl"
"$PY" -m trl_mdi.tiny --arch qwen2_5_vl --out "$OUT/tiny-qwen2_5_vl" --overwrite

echo "== 2/3 synthetic A-OKVQA-format data -> $OUT/aokvqa_synthetic"
"$PY" -m trl_mdi.synthetic --out "$OUT/aokvqa_synthetic" --n_train 512 --n_validation 64 --n_test 64 --overwrite

echo "== 3/3 prepare for TRL -> $OUT/aokvqa_trl_data_simple"
"$PY" data_prep/prepare_aokvqa_for_trl.py --dataset_path "$OUT/aokvqa_synthetic" \
    --out_dir "$OUT/aokvqa_trl_data_simple" --subset_size 200 --seed 0 --overwrite

echo
echo "model:    $OUT/tiny-qwen2_5_vl"
echo "data:     $OUT/aokvqa_trl_data_simple"
