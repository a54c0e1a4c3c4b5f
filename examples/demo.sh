#!/usr/bin/env bash
# `make demo`: the main job on the embedded default, offline, on CPU.
#   1. build a tiny Qwen2-VL (real classes, locally trained tokenizer) and warm it up with TRL's SFTTrainer on
#      200 labelled colour questions (python -m fixtures.warmup), stopped at about 60% held-out accuracy: what a
#      user does before GRPO, since a random model's groups collapse to one letter and carry no signal
#   2. write synthetic A-OKVQA-format colour questions (the image decides the answer)
#   3. convert them with data_prep/prepare_aokvqa_for_trl.py, exactly as for the real dataset
#   4. train with GRPO: examples/scripts/grpo_vlm.py under accelerate, 2 processes, DeepSpeed ZeRO-3 on CPU,
#      attention metrics and reliance signals on (per rollout: did the answer come from the image? scored again with
#      a black image), hyperparameters from examples/configs/demo.yaml; the logs show the reward rising
#   5. score the trained model on the warm-up's 200 held-out questions (greedy), to compare with step 1
#   6. profile both models (python -m trl_mdi.profile) on the 64 held-out validation questions of step 3, which GRPO
#      never trained on: attention layer by layer, and with --reliance the same answers without the image (a black
#      one): tables and pictures in $OUT/profile
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

echo "== 1/6 tiny Qwen2-VL, supervised warm-up -> $OUT/tiny-warm"
"$PY" -m fixtures.warmup --out "$OUT/tiny-warm" --overwrite

echo "== 2/6 synthetic A-OKVQA-format data -> $OUT/aokvqa_synthetic"
# The warm-up's question kinds and option order; seed 1, so the GRPO prompts are not the warm-up's 200 examples.
"$PY" -m fixtures.synthetic --out "$OUT/aokvqa_synthetic" --kinds color --option_order fixed --seed 1 \
    --n_train 2000 --n_validation 64 --n_test 64 --overwrite

echo "== 3/6 prepare for TRL -> $OUT/aokvqa_trl_data_simple"
"$PY" data_prep/prepare_aokvqa_for_trl.py --dataset_path "$OUT/aokvqa_synthetic" \
    --out_dir "$OUT/aokvqa_trl_data_simple" --subset_size 200 --seed 0 --overwrite

echo "== 4/6 GRPO training, 2 processes, DeepSpeed ZeRO-3 on CPU -> $OUT/grpo"
echo "   (the first run on a machine compiles a DeepSpeed op: about 40 s more)"
rm -rf "$OUT/grpo"
mkdir -p "$OUT/grpo"
touch "$OUT/grpo/.started"  # files newer than this are this run's logs
"$ACCELERATE" launch --config_file accelerate_configs/cpu_zero3.yaml examples/scripts/grpo_vlm.py \
    --config examples/configs/demo.yaml \
    --model_name_or_path "$OUT/tiny-warm" \
    --dataset_path "$OUT/aokvqa_trl_data_simple" \
    --output_dir "$OUT/grpo"

echo "== 5/6 held-out accuracy after GRPO (step 1 printed it after the warm-up)"
"$PY" -m fixtures.warmup --evaluate "$OUT/grpo"

echo "== 6/6 attention by layer and reliance on the image, before and after GRPO, on the held-out validation questions -> $OUT/profile"
# --reliance: each greedy answer scored again with a black image (the training's counterfactual, which removes the
# colour the questions ask about), and each question asked again without its image
"$PY" -m trl_mdi.profile --model_name_or_path "$OUT/tiny-warm" "$OUT/grpo" \
    --dataset_path "$OUT/aokvqa_trl_data_simple" --split validation --max_new_tokens 8 --batch_size 32 \
    --threads 1 --reliance --out "$OUT/profile"

CKPT=$(ls -d "$OUT"/grpo/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 || true)
LOGS=$(find "${TRL_MDI_LOG_DIR:-training_logs}" "$OUT/grpo" -name '*.md' ! -name README.md -newer "$OUT/grpo/.started" 2>/dev/null | sort || true)
MAPS=$(find "${TRL_MDI_LOG_DIR:-training_logs}" "$OUT/grpo" -type d -name '*_maps' -newer "$OUT/grpo/.started" 2>/dev/null | sort || true)
echo
echo "demo done in $((SECONDS - START)) s"
echo "model:          $OUT/tiny-warm (warm-up recipe and accuracy: warmup.json)"
echo "data:           $OUT/aokvqa_trl_data_simple"
echo "trained model:  $OUT/grpo (final model + processor)"
echo "checkpoint:     ${CKPT:-none}"
echo "metrics:        ${CKPT:+$CKPT/trainer_state.json} (log_history: rewards/*, attention/*, reliance/* for every step)"
for f in $LOGS; do echo "Markdown log:   $f   (tail -f it during a run)"; done
for d in $MAPS; do echo "attention maps: $d/ ($(ls "$d" | wc -l) PNG files)"; done
for f in $LOGS; do
    case "$f" in */rollout_results_*) echo "reliance:       $f (per rollout: vis gain, ans gain, blind; image evidence in bold)";; esac
done
echo "profile:        $OUT/profile/profile.md (per-layer tables, before vs after GRPO; at its end the section"
echo "                \"Reliance on the image\": accuracy with the image and with a black one, per model)"
echo "pictures:       $OUT/profile/mdi_by_layer.png, $OUT/profile/mass_by_layer.png"
echo "                $OUT/profile/reliance_*.png (each reliance signal's distribution per model)"
[ -n "$LOGS$MAPS" ] || echo "Markdown logs / attention maps: none written"
