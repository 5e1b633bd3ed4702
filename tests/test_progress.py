"""The lines a rank prints for a person while DeepSpeed compiles its CPU op (textsql/training/progress.py)."""

from __future__ import annotations

import threading
import time

from textsql.rank_lines import STAGE_PREFIX
from textsql.training.progress import SHM_OP_NAME, op_built, tick_while_building


def test_a_compiling_op_is_reported_every_interval_until_it_is_in_the_cache(tmp_path, capsys):
    ticks = threading.Thread(target=tick_while_building, args=(tmp_path, 0.05), daemon=True)
    ticks.start()
    seen = ""
    deadline = time.monotonic() + 30
    while seen.count("still compiling") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += capsys.readouterr().out
    assert seen.count("still compiling") >= 2, "a line every interval while the build runs"
    assert all(line.startswith(f"{STAGE_PREFIX}still compiling DeepSpeed's CPU op: ") for line in seen.splitlines())
    built = tmp_path / "py311_cpu" / SHM_OP_NAME / f"{SHM_OP_NAME}.so"
    built.parent.mkdir(parents=True)
    built.touch()
    assert op_built(tmp_path)
    ticks.join(timeout=30)
    assert not ticks.is_alive(), "the lines stop once the op is built"


def test_the_heartbeat_reports_steps_evaluations_and_saves_until_training_ends(capsys):
    from types import SimpleNamespace

    from textsql.rank_lines import HEARTBEAT_LINE
    from textsql.training.progress import Heartbeat

    heartbeat, args, state = (
        Heartbeat(interval_s=0.05),
        SimpleNamespace(process_index=1),
        SimpleNamespace(global_step=2),
    )
    heartbeat.on_train_begin(args, state, None)
    state.global_step = 3
    heartbeat.on_step_end(args, state, None)
    heartbeat.on_prediction_step(args, state, None)
    heartbeat.on_save(args, state, None)
    seen = ""
    deadline = time.monotonic() + 30
    while "progress 3" not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen += capsys.readouterr().out
    last = HEARTBEAT_LINE.match(seen.splitlines()[-1])
    assert (last["rank"], last["step"], last["progress"]) == ("1", "3", "3"), seen
    heartbeat.on_train_end(args, state, None)
    heartbeat.thread.join(timeout=30)
    assert not heartbeat.thread.is_alive(), "the heartbeat stops when training ends"
