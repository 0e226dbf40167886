"""`OPDTrainer` on two CPU processes under `accelerate launch` (DDP over gloo), as the README says it runs: both ranks
end with identical drafter weights, and the checkpoint the run writes loads and resumes.

`accelerate launch --cpu --num_processes 2` would start a single process: accelerate starts several CPU processes only
through mpirun. `--multi_gpu` starts them with torch.distributed.run, and the recipe's `use_cpu: true` makes
accelerate use gloo on the CPU.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from test_training_tools import write_recipe

from adaflash_hf import AdaFlashDrafter

WORKER = Path(__file__).with_name("distributed_worker.py")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(*args: str) -> None:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(_free_port()), str(WORKER), *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def test_two_cpu_processes_train_identical_drafters_and_resume(target, tokenizer, tmp_path):
    # per-device batch 2 on 2 ranks: each rank trains on its own half of every batch of 4
    recipe = write_recipe(tmp_path, target, tokenizer, per_device_train_batch_size=2, num_anchors=4, use_cpu=True)
    run = tmp_path / "run"
    _launch("--config", recipe, "max_steps=2")
    ranks = [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["step"] for r in ranks] == [2, 2]
    assert ranks[0]["sha256"] == ranks[1]["sha256"]  # DDP kept the replicas in step
    AdaFlashDrafter.from_pretrained(run / "checkpoint-2")  # the checkpoint loads as a drafter

    _launch("--config", recipe, "max_steps=3", "--resume_from_checkpoint", "true")
    ranks = [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in ranks] == [3, 3] and ranks[0]["sha256"] == ranks[1]["sha256"]
    state = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    # the resumed run continued the first one's log instead of starting over
    assert [row["step"] for row in state["log_history"] if "loss" in row] == [1, 2, 3]
