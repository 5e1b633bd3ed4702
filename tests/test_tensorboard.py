"""`textsql tensorboard` really serves, at CML's port when set; scalars come back from real event files."""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import pytest
from helpers.tensorboard import TEXTSQL, serve, stop, wait_for_run

from bench.tiny_run import tiny_run_argv
from textsql.display.tensorboard import Address, platform_address, plot_run, plot_scalars, read_scalars
from textsql.errors import TextSQLError
from textsql.training.events import ScalarsOnce
from worker.network import free_port


def write_events(logdir: Path, losses: list[float], tag: str = "train/loss") -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(logdir)) as writer:
        for step, loss in enumerate(losses, start=1):
            writer.add_scalar(tag, loss, global_step=step)


@pytest.mark.slow
def test_serves_event_files_on_a_free_port(tmp_path):
    write_events(tmp_path / "train" / "tensorboard", [3.0, 2.0, 1.0])
    process, url = serve(tmp_path, "--host", "127.0.0.1", "--port", "0")
    try:
        assert url.startswith("http://127.0.0.1:") and not url.startswith("http://127.0.0.1:6006/")
        assert wait_for_run(url, "train/tensorboard") == ["train/tensorboard"]
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and b"<html" in response.read().lower()
    finally:
        stop(process)


@pytest.mark.slow
def test_binds_cml_application_port_on_loopback(tmp_path):
    write_events(tmp_path / "run", [1.0])
    port = free_port()
    env = {"CDSW_APP_PORT": str(port), "CDSW_ENGINE_ID": "abc123", "CDSW_DOMAIN": "ml.example.com"}
    process, url = serve(tmp_path, env=env)
    try:
        assert url == f"http://127.0.0.1:{port}/"
        assert wait_for_run(url, "run") == ["run"]
    finally:
        stop(process)


def test_platform_address_follows_cml_variables():
    assert platform_address({}) == Address("localhost", 6006)
    assert platform_address(
        {"CDSW_READONLY_PORT": "8081", "CDSW_ENGINE_ID": "e1", "CDSW_DOMAIN": "cml.corp"}
    ) == Address("127.0.0.1", 8081, "https://read-only-e1.cml.corp/")
    both = {"CDSW_APP_PORT": "8100", "CDSW_READONLY_PORT": "8081"}
    assert platform_address(both) == Address("127.0.0.1", 8100, None)
    with pytest.raises(TextSQLError, match="CDSW_APP_PORT='x'.*--port"):
        platform_address({"CDSW_APP_PORT": "x"})


def test_reads_scalars_of_every_run(tmp_path):
    write_events(tmp_path / "a", [4.0, 3.0, 2.5])
    write_events(tmp_path / "b", [9.0], tag="eval/loss")
    scalars = read_scalars(tmp_path)
    assert scalars["a"]["train/loss"] == [(1, 4.0), (2, 3.0), (3, 2.5)]
    assert scalars["b"] == {"eval/loss": [(1, 9.0)]}


def test_plot_draws_one_line_per_run_and_tag(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    write_events(tmp_path, [4.0, 3.0, 2.0])
    figure = plot_scalars(tmp_path)
    (line,) = figure.axes[0].lines
    assert list(line.get_ydata()) == [4.0, 3.0, 2.0]
    with pytest.raises(TextSQLError, match="no eval/accuracy scalars"):
        plot_scalars(tmp_path, tags=("eval/accuracy",))


def test_missing_logdir_is_a_one_line_error(tmp_path):
    with pytest.raises(TextSQLError, match="no TensorBoard directory"):
        read_scalars(tmp_path / "missing")


def test_plot_run_draws_the_accuracy_beside_the_loss(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    write_events(tmp_path / "run", [4.0, 3.0])
    assert len(plot_run(tmp_path).axes) == 1, "no accuracy logged yet: the loss alone"
    write_events(tmp_path / "run", [0.0, 0.5], tag="eval/lf_accuracy")
    loss, accuracy = plot_run(tmp_path).axes
    assert [line.get_label() for line in loss.lines] == ["train/loss"]
    assert [line.get_label() for line in accuracy.lines] == ["eval/lf_accuracy"]


def test_a_run_a_worker_names_is_labelled_as_its_name_not_typeset(tmp_path):
    """Run names are directories under the run's tensorboard/, which the pods may write: matplotlib would typeset
    a name between ``$`` signs, and a broken one would fail the notebook's plot cell."""
    import matplotlib

    matplotlib.use("Agg")
    write_events(tmp_path / "honest", [4.0, 3.0])
    write_events(tmp_path / r"$\frac{$", [2.0, 1.0])
    figure = plot_run(tmp_path)
    figure.canvas.draw()
    legend = figure.axes[0].get_legend()
    assert [text.get_text() for text in legend.get_texts()] == [r"$\frac{$ train/loss", "honest train/loss"]
    assert not any(text.get_parse_math() for text in legend.get_texts()), "each label is drawn as its text"


def test_each_scalar_is_written_once_per_step(tmp_path):
    from transformers import TrainerState, TrainingArguments

    callback = ScalarsOnce()
    callback.logging_dir = str(tmp_path / "run")
    arguments, state = (
        TrainingArguments(output_dir=str(tmp_path), report_to=[]),
        TrainerState(global_step=4, is_world_process_zero=True),
    )
    callback.on_log(arguments, state, None, logs={"eval_loss": 1.0})
    callback.on_train_end(arguments, state, None)
    callback.on_log(arguments, state, None, logs={"eval_loss": 2.0, "eval_lf_accuracy": 0.5})
    callback.close()
    assert read_scalars(tmp_path) == {"run": {"eval/loss": [(4, 1.0)], "eval/lf_accuracy": [(4, 0.5)]}}
    assert len(list((tmp_path / "run").iterdir())) == 1, (
        "one event file: the writer outlives training for the final evaluation"
    )


@pytest.mark.slow
def test_a_real_run_is_named_after_its_directory_with_accuracy_and_no_repeats(prepared_sample, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output = tmp_path / "my-run"
    command = [
        *TEXTSQL,
        "train",
        *tiny_run_argv(
            prepared_sample,
            output,
            max_steps=4,
            eval_every=2,
            save_steps=4,
            per_device_eval_batch_size=4,
            disable_tqdm=None,
        ),
    ]
    result = subprocess.run(
        command, check=False, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    runs = [path.parent for path in (output / "tensorboard").rglob("events.out.tfevents.*")]
    assert runs == [output / "tensorboard" / "my-run"], "one event file, in a folder named after the run"
    events = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    pairs = [(tag, event.step) for tag in tags for event in events.Scalars(tag)]
    assert len(pairs) == len(set(pairs)), "a (tag, step) written twice"
    assert {"train/loss", "eval/loss", "eval/lf_accuracy", "eval/parse_rate"} <= set(tags)
    assert [event.step for event in events.Scalars("eval/lf_accuracy")] == [2, 4]
    assert "eval/ex_accuracy" not in tags, "the sample's tables carry no rows: no execution accuracy"
