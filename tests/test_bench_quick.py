"""gpu-quick's measuring parts on the CPU: the docs-tuned peer (bench/peer.py) and the old recipe trained for a few
steps in this process, the timeline of steady steps (bench/timeline.py) read from a real CPU profile. The run's
order, budget, skips and table are tests/test_bench_quick_run.py's; the whole run is rehearsed from a checkout in
tests/test_bench_checkout.py."""

import time
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from transformers import AutoConfig, DataCollatorForSeq2Seq

from bench.flops import T5Shape, training_flops
from bench.old_recipe import old_recipe
from bench.ours import StepWork
from bench.peer import PAD_MULTIPLE, RecordingCollator, peer_batch, peer_recipe
from bench.steps import StepClock
from bench.timeline import WINDOW, Timeline, busy_microseconds, summarize
from textsql.constants import DEFAULT_MODEL_DIR, LABEL_PAD_TOKEN_ID
from textsql.model import load_model, load_tokenizer

TINY_SHAPE = T5Shape.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL_DIR))


def test_busy_time_counts_overlapping_activity_once_and_only_inside_the_window():
    # Two streams overlapping 2-6 and 4-8, one gap, one interval running past the window's end.
    intervals = [(4.0, 8.0), (2.0, 6.0), (10.0, 12.0), (19.0, 30.0)]
    assert busy_microseconds(intervals, start=0.0, end=20.0) == 6.0 + 2.0 + 1.0
    assert busy_microseconds(intervals, start=5.0, end=11.0) == 3.0 + 1.0
    assert busy_microseconds([], start=0.0, end=1.0) == 0.0


def event(
    name: str,
    device: DeviceType,
    start: float,
    end: float,
    annotation: bool = False,
    parent: SimpleNamespace | None = None,
    kernels: tuple[str, ...] = (),
    shapes: tuple[list[int], ...] = (),
) -> SimpleNamespace:
    """What summarize reads of a profiler event."""
    return SimpleNamespace(
        name=name,
        device_type=device,
        is_user_annotation=annotation,
        time_range=SimpleNamespace(start=start, end=end),
        cpu_parent=parent,
        kernels=[SimpleNamespace(name=kernel) for kernel in kernels],
        input_shapes=list(shapes),
    )


def test_a_cuda_timeline_counts_kernels_and_copies_not_the_device_side_copies_of_annotations():
    """Kineto copies every record_function range to the GPU's timeline (the window's too): counted as kernels, they
    would make any window look busy."""
    events = [
        event(WINDOW, DeviceType.CPU, 0.0, 1000.0, annotation=True),
        event(WINDOW, DeviceType.CUDA, 0.0, 1000.0, annotation=True),
        event("bench::optimizer_phase", DeviceType.CUDA, 500.0, 900.0, annotation=True),
        event("aten::mm", DeviceType.CPU, 10.0, 20.0),  # the host's side: not the device's activity
        event("ampere_sgemm", DeviceType.CUDA, 100.0, 300.0),
        event("ampere_sgemm", DeviceType.CUDA, 250.0, 400.0),  # on another stream, overlapping
        event("Memcpy HtoD", DeviceType.CUDA, 600.0, 700.0),
    ]
    summary = summarize(events, steps=2, device_activity=True)
    assert summary["busy_fraction"] == 0.4 and summary["window_ms"] == 1.0 and summary["kernels_per_step"] == 1.5
    assert [(top["name"], top["total_ms"], top["calls"]) for top in summary["top_kernels"]] == [
        ("ampere_sgemm", 0.35, 2),
        ("Memcpy HtoD", 0.1, 1),
    ]
    assert summary["top_kernels"][0]["share_of_kernel_time"] == round(350 / 450, 4)


def test_a_cuda_timeline_says_where_each_top_kernel_was_launched_from():
    """The profiler links each kernel to the operator that launched it: a cast in the forward, the same cast's
    backward under its autograd node, and a copy inside a top-level operator are three places."""
    node = event("autograd::engine::evaluate_function: ToCopyBackward0", DeviceType.CPU, 300.0, 400.0)
    to = event("aten::to", DeviceType.CPU, 10.0, 20.0)
    cast_in_backward = event("aten::to", DeviceType.CPU, 310.0, 320.0, parent=node)
    copy_in_backward = event("aten::copy_", DeviceType.CPU, 311.0, 319.0, parent=cast_in_backward, kernels=("cast",))
    events = [
        event(WINDOW, DeviceType.CPU, 0.0, 1000.0, annotation=True),
        to,
        event("aten::copy_", DeviceType.CPU, 11.0, 19.0, parent=to, kernels=("cast",), shapes=([512, 512], [512, 512])),
        event("aten::copy_", DeviceType.CPU, 21.0, 29.0, parent=to, kernels=("cast",), shapes=([512, 512], [512, 512])),
        event("aten::mm", DeviceType.CPU, 30.0, 40.0, kernels=("gemm",)),
        node,
        cast_in_backward,
        copy_in_backward,
        event("cast", DeviceType.CUDA, 100.0, 110.0),
        event("cast", DeviceType.CUDA, 120.0, 130.0),
        event("cast", DeviceType.CUDA, 500.0, 510.0),
        event("gemm", DeviceType.CUDA, 200.0, 205.0),
    ]
    summary = summarize(events, steps=1, device_activity=True)
    places = {top["name"]: top["launched_by"] for top in summary["top_kernels"]}
    assert places == {
        "cast": [
            {"place": "forward: aten::to > aten::copy_", "calls": 2, "shapes": {"[512, 512]": 2}},
            {"place": "ToCopyBackward0: aten::to > aten::copy_", "calls": 1, "shapes": {"": 1}},
        ],
        "gemm": [{"place": "forward: aten::mm", "calls": 1, "shapes": {"": 1}}],
    }


def drive(timeline: Timeline, steps: list) -> None:
    """Run ``steps`` (callables) as a trainer would, calling the timeline around each."""
    for step in steps:
        timeline.on_step_begin(None, None, None)
        step()
        timeline.on_step_end(None, None, None)


def test_a_cpu_timeline_of_busy_steps_and_of_idle_steps_tells_them_apart():
    """Only the chosen steps are profiled; a window of matrix products is busy with aten::mm, a window spent asleep
    is not."""
    left, right = torch.randn(256, 256), torch.randn(256, 256)

    def compute():
        for _ in range(20):
            left @ right

    def idle():
        time.sleep(0.2)
        left @ right

    working = Timeline(first_step=2, steps=2)
    drive(working, [idle, compute, compute, idle])
    resting = Timeline(first_step=1, steps=1)
    drive(resting, [idle, compute])
    assert working.summary["steps"] == 2 and working.summary["activity"].startswith("CPU")
    assert working.summary["busy_fraction"] > 0.5 > resting.summary["busy_fraction"] > 0
    assert working.summary["kernels_per_step"] == 20
    assert working.summary["top_kernels"][0]["name"] == "aten::matmul"
    assert working.summary["top_kernels"][0]["calls"] == 40
    assert resting.summary["window_ms"] >= 200
    with pytest.raises(ValueError, match="first_step"):
        Timeline(first_step=0, steps=1)


def test_the_peer_batch_is_the_defaults_questions_a_step_in_multiples_of_eight():
    assert peer_batch(349.7) == 344 and peer_batch(8.0) == 8 and peer_batch(3.2) == PAD_MULTIPLE


def test_the_recording_collator_pads_per_batch_and_records_real_tokens_only():
    model = load_model(str(DEFAULT_MODEL_DIR))
    collator = RecordingCollator(
        DataCollatorForSeq2Seq(load_tokenizer(str(DEFAULT_MODEL_DIR)), model=model, pad_to_multiple_of=8), TINY_SHAPE
    )
    features = [
        {"input_ids": [5, 6, 7, 1], "attention_mask": [1, 1, 1, 1], "labels": [8, 1]},
        {"input_ids": [5, 1], "attention_mask": [1, 1], "labels": [9, 10, 11, 1]},
    ]
    batch = collator(features)
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].shape == (2, 8)  # padded to the multiple
    assert batch["labels"][0].tolist() == [8, 1] + [LABEL_PAD_TOKEN_ID] * 6
    assert "decoder_input_ids" in batch  # the model shifts the labels, as the docs' collator does
    flops = training_flops(TINY_SHAPE, 4, 2) + training_flops(TINY_SHAPE, 2, 4)
    assert collator.batches == [StepWork(2, flops, 12)]


def test_the_peer_trains_its_steps_and_records_each_steps_work(prepared_sample, tmp_path):
    """The docs' Seq2SeqTrainer (length-grouped, fused AdamW, dynamic padding) on the CPU: every step clocked, every
    batch's work recorded in step order, a timeline of the step after the others."""
    timeline = Timeline(first_step=3, steps=1)
    record = peer_recipe(
        DEFAULT_MODEL_DIR,
        prepared_sample,
        tmp_path / "out",
        StepClock(),
        max_steps=3,
        device="cpu",
        batch=8,
        shape=TINY_SHAPE,
        callbacks=(timeline,),
    )
    assert len(record["step_ended"]) == 3 and record["memory_measure"].startswith("peak_rss")
    work = [StepWork(*step) for step in record["step_work"]]
    assert len(work) >= 3 and all(step.samples == 8 for step in work)
    assert all(step.tokens > 0 and step.flops > 0 for step in work)
    assert timeline.summary["steps"] == 1 and 0 < timeline.summary["busy_fraction"] <= 1


def test_the_old_recipe_returns_the_op_counts_of_the_step_it_profiled(prepared_sample, tmp_path):
    """The record is read after training, so the profiled last step's op counts are in it."""
    record = old_recipe(
        DEFAULT_MODEL_DIR,
        prepared_sample,
        tmp_path / "out",
        StepClock(profile_step=2),
        max_steps=2,
        device="cpu",
        batch=4,
    )
    assert len(record["step_ended"]) == 2 and record["ops"] is not None and record["ops"]["ops"] > 0
