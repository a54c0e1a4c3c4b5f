"""GRPO for vision-language models with MDI/AEI attention metrics: the training entry point.

Every flag of MDIGRPOConfig (TRL's GRPOConfig plus trl_mdi's), TRL's ModelConfig and the data arguments works on
the command line and in a YAML file given with --config (command-line flags win). `--help` lists them all. The
logic lives in trl_mdi.cli (parsing, checks, printing) and trl_mdi.data (loading); this file only calls it.

Real runs (from the repository root):

    # A-OKVQA, prepared with data_prep/prepare_aokvqa_for_trl.py, Qwen2.5-VL-3B on 8 GPUs with ZeRO-3
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml examples/scripts/grpo_vlm.py \\
        --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --output_dir grpo-Qwen2.5-VL-3B-Instruct \\
        --learning_rate 1e-5 --gradient_checkpointing --dtype bfloat16 --max_completion_length 1024 \\
        --dataset_path ./aokvqa_trl_data_simple --log_completions

    # the same with LoRA on the language model's attention projections
    ... --use_peft --lora_target_modules q_proj k_proj v_proj o_proj

    # generation with vLLM inside the training processes
    ... --use_vllm --vllm_mode colocate

The CPU demo (`make demo`, examples/demo.sh) runs it on a tiny Qwen2.5-VL with 2 processes and ZeRO-3:

    accelerate launch --config_file accelerate_configs/cpu_zero3.yaml examples/scripts/grpo_vlm.py \\
        --config examples/configs/demo.yaml --model_name_or_path demo_run/tiny-qwen2_5_vl \\
        --dataset_path demo_run/aokvqa_trl_data_simple --output_dir demo_run/grpo

Exit status: 0 done, 2 bad input (unknown flag, missing data, model that is not a VLM: one message on stderr).
"""

import sys

from trl_mdi.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
