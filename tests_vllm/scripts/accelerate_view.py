"""What accelerate makes of a 2-process CPU launch, with and without ``use_cpu``, and what the trainer's launch check
says of each: run under ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml`` (2 processes).

argv: out_jsonl. Each rank appends one record per setting: accelerate's process count and distributed type as
``TrainingArguments`` set them up (``ddp_backend="gloo"``, as the entry point sets on a CPU machine), what
``accelerate.utils.gather`` returns of each rank's index (TRL gathers the rewards with it), and the error
``trl_mdi.run_plan.check_world_size`` raises for it (None when it passes). No model, no vLLM: seconds per rank.
"""

import json
import os
import sys

import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, gather
from transformers import TrainingArguments

from trl_mdi.run_plan import check_world_size


def main():
    out = sys.argv[1]
    world = int(os.environ["WORLD_SIZE"])
    for use_cpu in (False, True):
        # Each setting sets up accelerate's state afresh (the gloo group, once created, is reused).
        AcceleratorState._reset_state(reset_partial_state=True)
        args = TrainingArguments(output_dir=os.path.dirname(out), use_cpu=use_cpu, ddp_backend="gloo",
                                 report_to="none")
        args.device  # noqa: B018 - sets up accelerate's state as a trainer does
        state = PartialState()
        gathered = gather(torch.tensor([state.process_index])).tolist()  # what TRL's reward gather would see
        try:
            check_world_size(state.num_processes, state.distributed_type != DistributedType.NO, world)
            error = None
        except RuntimeError as e:
            error = str(e)
        record = {"rank": state.process_index, "use_cpu": use_cpu, "num_processes": state.num_processes,
                  "distributed_type": str(state.distributed_type), "gathered": gathered, "error": error}
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
    # Leave the gloo group together: a rank that exits with the group alive can abort in gloo's teardown ("terminate
    # called without an active exception", SIGABRT) when the other rank has closed its end first, which CI hit on a
    # loaded machine after both ranks had written their records.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
