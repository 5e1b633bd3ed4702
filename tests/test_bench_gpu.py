"""The GPU bench: its arithmetic on the CPU, its clean absence without CUDA, the section rehearsed on the CPU from a
copy of the tree with no ``../shared`` beside it (``bench_checkout``, tests/test_bench_checkout.py rehearses
``gpu-quick`` there, tests/test_bench_device.py ``bench/device.sh``), the real thing marked gpu."""

import json

import pytest
from helpers.bench import run_bench

from bench import __main__ as bench_main
from bench.flops import T5Shape, training_flops
from bench.gpu import Sizes, curves_match
from bench.ours import available, step_samples
from bench.steps import count_ops, step_times, timed_window, training_seconds_to
from textsql.constants import PROJECT_DIR
from textsql.training.batching import TokenBudgetBatchSampler

TINY = T5Shape(d_model=8, d_attention=8, d_ff=16, encoder_layers=1, decoder_layers=1, vocab_size=32)
# What the gpu section writes on any device, each profile's row of it, and the op counts of a profiled step.
SECTION_KEYS = (
    "value",
    "unit",
    "goal",
    "device",
    "versions",
    "data",
    "peak_flops",
    "token_budget",
    "old_recipe_samples_per_s",
    "old_recipe_mfu_real_tokens",
    "profiles",
    "step_ops",
    "seconds_to_eval_loss",
    "loss_curve_vs_eager_fp32",
    "inference",
    "flop_convention",
    "loss_vocabulary",
    "method",
)
ROW_KEYS = (
    "profile",
    "samples_per_s",
    "real_tokens_per_s",
    "vs_old_recipe",
    "mfu_real_tokens",
    "max_memory_gib_per_rank",
    "estimate_gpu_gb_per_rank",
    "ops_per_step",
    "loss_vocabulary",
)
OPS_KEYS = ("ops", "host_syncs", "reduce_calls", "optimizer_ops", "optimizer_host_syncs")


def record(steps: int, profiled: bool = False) -> dict:
    """A clock record of ``steps`` steps of one second each, the last profiled when asked."""
    return {
        "step_began": [float(i) for i in range(steps)],
        "step_ended": [i + 1.0 for i in range(steps)],
        "evaluations": [],
        "ops": {"ops": 1} if profiled else None,
    }


@pytest.mark.parametrize("steps", range(8))
@pytest.mark.parametrize("skip", range(4))
def test_the_timed_window_never_divides_by_zero_whatever_the_step_count(steps, skip):
    """The old bench divided by zero (or raised StopIteration) when at most one logged step followed the warm-up."""
    if skip >= 1 and steps > skip:
        assert timed_window(record(steps), skip) == (steps - skip, float(steps - skip))
        assert timed_window(record(steps + 1, profiled=True), skip) == (steps - skip, float(steps - skip))
    else:
        with pytest.raises(ValueError, match="warm-up"):
            timed_window(record(steps), skip)


def test_sizes_refuse_a_run_with_no_timed_step():
    with pytest.raises(ValueError, match="timed_steps"):
        Sizes(warmup_steps=2, timed_steps=0)
    assert Sizes(warmup_steps=1, timed_steps=1).steps == 3  # warm-up, timed, profiled
    with pytest.raises(ValueError, match="multiple of 32"):
        Sizes(eval_questions=8)  # the old recipe would drop its only, partial, evaluation batch


def test_time_to_loss_leaves_out_the_evaluations_before_it():
    clock = record(6)
    clock["evaluations"] = [
        {"step": 2, "eval_loss": 3.0, "seconds": 10.0},
        {"step": 4, "eval_loss": 0.9, "seconds": 10.0},
    ]
    # Steps 1-4 end at 4 s of step time, but the clock read 4 s after the first evaluation's 10 s.
    clock["step_ended"] = [1.0, 2.0, 13.0, 14.0, 15.0, 16.0]
    assert training_seconds_to(clock, 1.0) == 4.0
    assert training_seconds_to(clock, 0.5) is None


def test_op_counts_read_a_real_profile():
    import torch

    from bench.steps import OPTIMIZER_PHASE

    weights = [torch.randn(4, 4, requires_grad=True) for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss = sum((w * 2).sum() for w in weights)
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_PHASE):
            for w in weights:  # a per-tensor loop with a host read each: what the default step must not do
                w.data.add_(w.grad, alpha=-0.1)
                float(w.grad.norm())
        fused = torch.optim.AdamW(weights, lr=0.1, fused=True)
        with torch.profiler.record_function(OPTIMIZER_PHASE):
            fused.step()  # its CPU kernel reads each step count with .item(); a GPU's does not
    counts = count_ops(profile.events())
    assert counts["optimizer_ops"] >= 6 and counts["optimizer_host_syncs"] == 3
    assert counts["host_syncs"] == 3 and counts["ops"] > counts["optimizer_ops"] and counts["reduce_calls"] == 0


def test_compute_ops_count_the_work_once_not_views_or_allocations():
    import torch

    tensors = [torch.randn(4, 4) for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        viewed = tensors[0].t().reshape(16).view(4, 4).narrow(0, 1, 2)  # views: none
        torch.empty_like(viewed)  # an allocation: none
        torch._foreach_add_(tensors, 1.0)  # one multi-tensor op, however many tensors: 1
        tensors[0] @ tensors[1]  # a product: 1
        tensors[0].t().contiguous()  # a copy, under clone: 1
    counts = count_ops(profile.events())
    assert counts["compute_ops"] == 3 and counts["ops"] == 9


def test_identical_curves_match_and_diverging_ones_do_not():
    curve = [4.0 / (1 + step / 20) for step in range(100)]
    assert curves_match(curve, curve, 0.05)["within"]
    assert curves_match(curve, [value * 1.02 for value in curve], 0.05)["within"]
    assert not curves_match(curve, [value * 1.5 for value in curve], 0.05)["within"]
    with pytest.raises(ValueError):
        curves_match(curve[:3], curve[:3], 0.05)


def test_step_samples_rebuild_every_epoch_of_the_seeded_sampler():
    lengths = ([10 + i % 40 for i in range(200)], [5 + i % 17 for i in range(200)])
    per_epoch = len(TokenBudgetBatchSampler(*lengths, 512, seed=42))
    steps = step_samples(lengths, 512, TINY, 2 * per_epoch)
    assert len(steps) == 2 * per_epoch and sum(step.samples for step in steps) == 400
    assert sum(step.tokens for step in steps) == 2 * (sum(lengths[0]) + sum(lengths[1]))  # real tokens, no padding
    total_flops = sum(training_flops(TINY, s, t) for s, t in zip(*lengths))
    assert sum(step.flops for step in steps) == pytest.approx(2 * total_flops)
    assert step_samples(lengths, 512, TINY, 3) == steps[:3]


@pytest.mark.slow  # the bench in a fresh Python
@pytest.mark.skipif(available(), reason="this machine has CUDA: the section is measured instead")
def test_without_cuda_the_gpu_section_is_skipped_and_nothing_else_changes(tmp_path):
    before = json.loads((PROJECT_DIR / "bench" / "results.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps(before))
    results = run_bench(tmp_path, "--only", "gpu", timeout=300)
    assert "gpu" not in results
    figures = [key for key in before if key not in ("machine", "releases", "started", "finished")]
    assert figures and all(results[key] == before[key] for key in figures)


# 10.5 to 23 minutes on this project's 2 shared cores (load average 12-15): four DeepSpeed
# launches, each paying the launcher's and the rank's start-up.
CPU_SECTION_S = 1800


@pytest.mark.slow
@pytest.mark.timeout(CPU_SECTION_S + 60)  # past the suite's 900 s, so the bench's own bound fires first
def test_the_gpu_section_runs_on_the_cpu_at_smoke_size_and_writes_every_key(bench_checkout, tmp_path):
    """The same code as on a GPU, with the tiny T5, a few steps and the CPU's nominal peak, from the checkout."""
    figure = run_bench(
        tmp_path, "gpu", "--device", "cpu", timeout=CPU_SECTION_S, capture_output=False, project=bench_checkout
    )["gpu"]
    assert set(SECTION_KEYS) <= set(figure), set(SECTION_KEYS) - set(figure)
    assert set(figure["profiles"]) == {"default", "zero1"} and figure["profiles"]["default"]["profile"] == "zero1"
    for row in figure["profiles"].values():
        assert set(ROW_KEYS) <= set(row) and row["samples_per_s"] > 0 and row["mfu_real_tokens"] > 0
        assert set(OPS_KEYS) <= set(row["ops_per_step"])
    for arm in ("default", "old_recipe"):
        assert set(OPS_KEYS) <= set(figure["step_ops"][arm]) and figure["step_ops"][arm]["ops"] > 0
    assert figure["old_recipe_samples_per_s"] > 0 and figure["value"] > 0
    assert figure["seconds_to_eval_loss"]["old_recipe"] > 0 and figure["seconds_to_eval_loss"]["defaults"] > 0
    assert "within" in figure["loss_curve_vs_eager_fp32"] and figure["inference"]["value"] > 0
    assert figure["device"] == "cpu" and "56355 training questions" in figure["data"]
    assert figure["loss_vocabulary"] == {"old_recipe": "full", "defaults": "full"}
    assert {row["loss_vocabulary"] for row in figure["profiles"].values()} == {"full"}
    assert "gpu" in (tmp_path / "README.md").read_text()


@pytest.mark.gpu
@pytest.mark.slow
def test_the_gpu_section_runs_at_smoke_size(tmp_path):
    figure = run_bench(tmp_path, "--only", "gpu", timeout=840)["gpu"]  # under the suite's 900 s per test
    assert figure["old_recipe_samples_per_s"] > 0 and figure["profiles"]["default"]["samples_per_s"] > 0
    assert figure["device"] and figure["versions"]["cuda"]


def test_throughput_gives_tokens_per_second_beside_samples_per_second():
    from bench.ours import StepWork, throughput

    per_step = [StepWork(10, 100.0, 1000), StepWork(20, 200.0, 3000), StepWork(30, 300.0, 5000)]
    assert throughput(record(3), per_step, skip=1) == StepWork(25.0, 250.0, 4000.0)  # steps 2-3 over 2 s


def test_the_gpu_quick_table_shows_tokens_per_second_beside_samples_per_second():
    from bench.quick_report import table

    arm = {
        "label": "x",
        "samples_per_s": 508.1,
        "real_tokens_per_s": 40123,
        "mfu_real_tokens": 0.05,
        "peak_memory_gib": 1.0,
        "loss_vocabulary": "full",
        "warmup_s": 3.0,
        "median_step_s": 0.06,
        "slowest_step_s": 0.07,
    }
    shown = table(
        {"device": "H100", "versions": {"torch": "2", "cuda": "13"}, "model": "m", "arms": {"old_recipe": arm}}
    )
    header, _, row = shown.splitlines()[2:5]
    assert header.startswith("| arm | samples/s | real tokens/s |") and row.startswith("| old_recipe | 508.1 | 40123 |")


# Two recompilations as torch 2.11's TORCH_LOGS=recompiles wrote them in a rank's log on an H200 (shortened).
RECOMPILE_LOG = """\
heartbeat rank 0 step 1 progress 1
[rank0]:V1127 12:21:40.580000 829 torch/_dynamo/guards.py:4760] [12/1] [__recompiles] Recompiling function forward in /x/modeling_t5.py:937
[rank0]:V1127 12:21:40.580000 829 torch/_dynamo/guards.py:4760] [12/1] [__recompiles]     triggered by the following guard failure(s):
[rank0]:V1127 12:21:40.580000 829 torch/_dynamo/guards.py:4760] [12/1] [__recompiles]     - 12/0: 512*input_ids.size()[1]*input_ids.size()[0] >= 5242880  # (_inductor/scheduler.py:326 in can_fuse)
step 10/230: loss 8.239 (160 s)
[rank0]:V1127 12:22:34.320000 829 torch/_dynamo/guards.py:4760] [12/2] [__recompiles] Recompiling function forward in /x/modeling_t5.py:937
[rank0]:V1127 12:22:34.320000 829 torch/_dynamo/guards.py:4760] [12/2] [__recompiles]     triggered by the following guard failure(s):
[rank0]:V1127 12:22:34.320000 829 torch/_dynamo/guards.py:4760] [12/2] [__recompiles]     - 12/0: (input_ids.size()[1] % 16) != 0  # (_meta_registrations.py:6232 in meta__scaled_dot_product_efficient_backward)
"""


def test_recompilations_are_counted_with_the_guard_that_failed(tmp_path):
    from bench.quick_arms import recompilations

    log = tmp_path / "bench.log"
    log.write_text(RECOMPILE_LOG)
    found = recompilations(log)
    assert found["count"] == 2
    assert found["first_guards_failed"][0].startswith("12/0: 512*input_ids.size()[1]*input_ids.size()[0] >= 5242880")
    assert "meta__scaled_dot_product_efficient_backward" in found["first_guards_failed"][1]
    log.write_text("step 10/230: loss 8.239 (160 s)\n")
    assert recompilations(log) == {"count": 0, "first_guards_failed": []}


def test_regions_left_out_of_cuda_graphs_are_counted_with_the_reason(tmp_path):
    from bench.quick_arms import graphs_skipped

    log = tmp_path / "bench.log"
    log.write_text(
        "[rank0]:W1130 09:10:00.000000 829 torch/_inductor/cudagraph_utils.py:380] [3/0] skipping cudagraphs due to "
        "mutated inputs (1 instances). Found from : File modeling_t5.py, line 335\n"
        "step 10/230: loss 8.239 (160 s)\n"
    )
    found = graphs_skipped(log)
    assert found["count"] == 1 and found["first_reasons"][0].startswith("mutated inputs (1 instances)")
    log.write_text("step 10/230: loss 8.239 (160 s)\n")
    assert graphs_skipped(log) == {"count": 0, "first_reasons": []}


@pytest.mark.parametrize("defaults_compile", [True, False])
def test_the_price_of_torch_compile_is_the_same_whichever_arm_the_defaults_are(defaults_compile):
    from bench.quick_report import compile_price

    eager = {"torch_compile": False, "wall_s": 44.0, "median_step_s": 0.06, "samples_per_s": 5000.0}
    compiled = {"torch_compile": True, "wall_s": 227.0, "median_step_s": 0.04, "samples_per_s": 2000.0}
    arms = {"old_recipe": {"samples_per_s": 500.0}}
    arms |= (
        {"defaults": compiled, "defaults_eager": eager}
        if defaults_compile
        else {"defaults": eager, "defaults_compiled": compiled}
    )
    price = compile_price(arms, steps=230)["compile"]
    # 183 s more over 230 steps, 0.02 s saved a step: even after 230 + 183 / 0.02 = 9,380 steps.
    assert price == {
        "extra_wall_s": 183.0,
        "median_step_s_saved": 0.02,
        "samples_per_s_over_eager": 0.4,
        "break_even_steps": 9380,
    }
    assert compile_price({"old_recipe": {}, "defaults": eager}, steps=230) == {}  # the CPU smoke run: one arm
    slower = {**compiled, "median_step_s": 0.07}
    assert compile_price({"defaults": eager, "defaults_compiled": slower}, 230)["compile"]["break_even_steps"] is None


def test_a_warm_compile_cache_is_priced_apart_from_the_first_compilation():
    from bench.quick_report import compile_price, table

    eager = {"torch_compile": False, "wall_s": 44.0, "median_step_s": 0.06, "samples_per_s": 5000.0}
    cold = {"torch_compile": True, "wall_s": 227.0, "median_step_s": 0.04, "samples_per_s": 2000.0}
    warm = {**cold, "wall_s": 64.0}
    prices = compile_price({"defaults": eager, "defaults_compiled": cold, "defaults_compiled_warm": warm}, 230)
    # 20 s more, 0.02 s saved a step: even after 230 + 20 / 0.02 = 1,230 steps.
    assert prices["compile"]["break_even_steps"] == 9380 and prices["compile_warm"]["break_even_steps"] == 1230
    lines = table({"versions": {"torch": "2", "cuda": "12"}, "device": "x", "model": "y", "arms": {}, **prices})
    assert "with the cache the first run left: 20.0 s more than eager" in lines and "after 1230 steps" in lines


def test_step_times_separate_the_warm_up_from_the_timed_steps():
    clock = record(6)
    clock["step_ended"] = [30.0, 31.0, 32.0, 33.0, 35.0, 36.0]  # a 30 s first step (compilation), then one slow one
    assert step_times(clock, 2) == {
        "warmup_steps": 2,
        "timed_steps": 4,
        "warmup_s": 31.0,
        "median_step_s": 1.0,
        "slowest_step_s": 2.0,
    }


@pytest.mark.skipif(available(), reason="this machine has CUDA: gpu-quick runs at full size here")
def test_gpu_quick_at_full_size_without_cuda_names_the_rehearsal(capsys):
    with pytest.raises(SystemExit) as stopped:
        bench_main.main(["gpu-quick"])
    assert stopped.value.code == 2 and "--device cpu --smoke" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        bench_main.main(["gpu-quick", "--device", "cpu"])  # the CPU has no token budget of the defaults' own
    assert stopped.value.code == 2 and "--device cpu --smoke" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        bench_main.main(["gpu-quick", "gpu", "--device", "cpu", "--smoke"])
    assert stopped.value.code == 2 and "runs alone" in capsys.readouterr().err


@pytest.mark.parametrize("cuda", [True, False])
def test_the_step_clock_waits_for_the_gpu_before_each_read_where_cuda_is_in_use(monkeypatch, cuda):
    import torch

    from bench import steps

    happened = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: happened.append("synchronize"))
    monkeypatch.setattr(steps.time, "perf_counter", lambda: happened.append("read") or float(len(happened)))
    clock = steps.StepClock()
    clock.on_step_begin(None, None, None)
    clock.on_step_end(None, None, None)
    assert happened == (["synchronize", "read"] * 2 if cuda else ["read"] * 2)
    assert len(clock.step_began) == len(clock.step_ended) == 1
