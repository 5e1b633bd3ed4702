"""`textsql launch` running the real training on two real worker pods over pdsh.

One run shows the two-host path and kill-and-resume together (two launches, not three, to keep CI
short): the workers register through the rendezvous, pdsh reaches them with their host keys
verified, the run is interrupted once its first checkpoint is complete, every rank on both hosts
ends, and `--resume-from-checkpoint auto` continues from that checkpoint's global step and data position to the
consolidated model/.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from helpers.launch import HOSTS, on_cluster, tagged_processes, textsql_launch

from bench.tiny_run import tiny_run_argv
from textsql.arguments import train_argv
from textsql.planning.recipe import square_root_scaled
from textsql.rundir.checkpoints import newest_complete_checkpoint

# Enough steps after the first checkpoint that the interrupt lands mid-run.
MAX_STEPS = 30
# A tiny run that saves every 2 steps and evaluates only at the end.
# Batched to a token budget, so that the recipe's rate counts both ranks' tokens (read from each rank's WORLD_SIZE).
TOKEN_BUDGET = 2048
TRAIN_ARGS = {
    "save_steps": 2,
    "log_level": "info",
    "generation_max_length": None,
    "disable_tqdm": None,
    "max_tokens_per_batch": TOKEN_BUDGET,
}


def start(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 900) -> float:
    """Seconds until condition() holds; fails if the process ends first."""
    started = time.monotonic()
    while not condition():
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() - started < timeout, log.read_text()[-4000:]
        time.sleep(0.5)
    return time.monotonic() - started


@pytest.mark.slow
# The sum of its bounds: the workers (120 s), the first step and a checkpoint (900 s each), the interrupt (120 s)
# and the resumed run (900 s); past the suite's 900 s, so each bound can fire, with the launch's log.
@pytest.mark.timeout(120 + 900 + 900 + 120 + 900 + 60)
def test_two_hosts_train_killed_after_first_checkpoint_and_resumed_to_the_end(
    two_local_workers, prepared_sample: Path, tmp_path: Path
) -> None:
    run_dir, out = two_local_workers.run_dir, tmp_path / "out"
    tag = {"LAUNCH_TEST_TAG": uuid.uuid4().hex}
    args = ["--", *tiny_run_argv(prepared_sample, out, max_steps=MAX_STEPS, eval_every=1000, **TRAIN_ARGS)]

    first_log = tmp_path / "first.log"
    first = start(textsql_launch(out, *on_cluster(run_dir), env=tag) + args, first_log)
    to_first_step = wait_for(lambda: re.search(r"step \d+/\d+: loss ", first_log.read_text()), first, first_log)
    # Whichever checkpoint is complete when looked at: at a step a fraction of a second long, checkpoint-2
    # may already be rotated away (save_total_limit 2) by the time the poll comes.
    wait_for(lambda: newest_complete_checkpoint(out) is not None, first, first_log)
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=120) != 0
    assert not (out / "model").exists(), "the run ended before it could be interrupted"
    assert tagged_processes(tag["LAUNCH_TEST_TAG"]) == [], "training processes left behind"
    checkpoint = newest_complete_checkpoint(out)
    step = int(checkpoint.rsplit("-", 1)[1])
    assert step < MAX_STEPS

    second_log = tmp_path / "second.log"
    started = time.monotonic()
    resumed = [*args, *train_argv(resume_from_checkpoint="auto")]
    second = start(textsql_launch(out, *on_cluster(run_dir), env=tag) + resumed, second_log)
    assert second.wait(timeout=900) == 0, second_log.read_text()[-4000:]
    resumed_run = time.monotonic() - started
    output = second_log.read_text()
    # Token-budget batches of the small sample make short epochs: the checkpoint's step may lie in a later one.
    resumed_at = re.search(rf"Resuming training from checkpoint with epoch (\d+) and global step {step}\n", output)
    assert resumed_at, output[-4000:]
    assert f"Fast-forwarding the dataloader past {resumed_at[1]} epochs and " in output
    for host in HOSTS:
        assert f"{host}: " in output
    summary = json.loads((out / "run.json").read_text())
    assert summary["resumed_from"] == checkpoint and summary["global_step"] == MAX_STEPS
    assert summary["world_size"] == 2 and summary["engine"].endswith("DeepSpeedEngine")
    assert summary["token_budget"]["cuda_max_memory_allocated_gib"] is None  # CPU ranks: no GPU peak to report
    # The launcher told each rank its world: the rate is scaled to the tokens of both ranks' batches, not one's.
    assert summary["recipe"]["peak_learning_rate"] == square_root_scaled(1e-3, 2 * TOKEN_BUDGET) == 1.26e-3
    # The resumed launch's collective check: its result and bandwidth per host.
    per_host = summary["collective"]["per_host"]
    assert [(host["host"], host["result"]) for host in per_host] == [("127.0.0.2", "ok"), ("127.0.0.3", "ok")]
    assert all(host["sizes"][-1]["bus_gbps"] > 0 for host in per_host)
    logged_steps = [entry["step"] for entry in summary["log_history"] if "loss" in entry]
    assert logged_steps == list(range(1, MAX_STEPS + 1)), "steps were repeated or skipped across the resume"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (out / "model").iterdir()
    }
    assert tagged_processes(tag["LAUNCH_TEST_TAG"]) == []
    print(f"launch to first step {to_first_step:.1f} s; resumed run to the end {resumed_run:.1f} s")
