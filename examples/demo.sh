#!/usr/bin/env bash
# `make demo`: the main job on the embedded default, offline, on CPU.
#   1. build a tiny Qwen2.5-VL (real classes, random weights, locally trained tokenizer)
#   2. write synthetic A-OKVQA-format data (colour / shape / count questions that need the image)
#   3. convert it with data_prep/prepare_aokvqa_for_trl.py, exactly as for the real dataset
#   4. train it with GRPO for a few steps: examples/scripts/grpo_vlm.py under accelerate, 2 processes, DeepSpeed
#      ZeRO-3 on CPU, attention metrics on, hyperparameters from examples/configs/demo.yaml
set -euo pipefail
OUT="${1:-demo_run}"
PY="${PYTHON:-.venv/bin/python}"
ACCELERATE="${ACCELERATE:-$(dirname "$PY")/accelerate}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false
# torch and transformers warn about their own deprecated calls once per step and process (~250 lines); a
# PYTHONWARNINGS of your own is kept.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning}"
mkdir -p "$OUT"
START=$SECONDS

echo "== 1/4 tiny Qwen2.5-VL -> $OUT/tiny-qwen2_5_vl"
"$PY" -m trl_mdi.tiny --arch qwen2_5_vl --out "$OUT/tiny-qwen2_5_vl" --overwrite

echo "== 2/4 synthetic A-OKVQA-format data -> $OUT/aokvqa_synthetic"
"$PY" -m trl_mdi.synthetic --out "$OUT/aokvqa_synthetic" --n_train 512 --n_validation 64 --n_test 64 --overwrite

echo "== 3/4 prepare for TRL -> $OUT/aokvqa_trl_data_simple"
"$PY" data_prep/prepare_aokvqa_for_trl.py --dataset_path "$OUT/aokvqa_synthetic" \
    --out_dir "$OUT/aokvqa_trl_data_simple" --subset_size 200 --seed 0 --overwrite

echo "== 4/4 GRPO training, 2 processes, DeepSpeed ZeRO-3 on CPU -> $OUT/grpo"
echo "   (the first run on a machine compiles a DeepSpeed op: about 40 s more)"
rm -rf "$OUT/grpo"
mkdir -p "$OUT/grpo"
touch "$OUT/grpo/.started"  # files newer than this are this run's logs
"$ACCELERATE" launch --config_file accelerate_configs/cpu_zero3.yaml examples/scripts/grpo_vlm.py \
    --config examples/configs/demo.yaml \
    --model_name_or_path "$OUT/tiny-qwen2_5_vl" \
    --dataset_path "$OUT/aokvqa_trl_data_simple" \
    --output_dir "$OUT/grpo"

CKPT=$(ls -d "$OUT"/grpo/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 || true)
LOGS=$(find training_logs "$OUT/grpo" -name '*.md' ! -name README.md -newer "$OUT/grpo/.started" 2>/dev/null | sort || true)
MAPS=$(find training_logs "$OUT/grpo" -type d -name '*_maps' -newer "$OUT/grpo/.started" 2>/dev/null | sort || true)
echo
echo "demo done in $((SECONDS - START)) s"
echo "model:          $OUT/tiny-qwen2_5_vl"
echo "data:           $OUT/aokvqa_trl_data_simple"
echo "trained model:  $OUT/grpo (final model + processor)"
echo "checkpoint:     ${CKPT:-none}"
echo "metrics:        ${CKPT:+$CKPT/trainer_state.json} (log_history: rewards/*, attention/* for every step)"
for f in $LOGS; do echo "Markdown log:   $f   (tail -f it during a run)"; done
for d in $MAPS; do echo "attention maps: $d/ ($(ls "$d" | wc -l) PNG files)"; done
[ -n "$LOGS$MAPS" ] || echo "Markdown logs / attention maps: none written"
