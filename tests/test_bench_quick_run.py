"""gpu-quick's run with its arms stubbed (bench/gpu_quick.py, bench/quick_report.py): the arms' order, the ratios
saved after each, what the budget and --skip leave out, and the table. The arms themselves are measured in
tests/test_bench_quick.py."""

import json
import time

import pytest


class StubLoad:
    device_name, model_label, peak, model = "H200", "m", 1.0, "t5-small-load"

    def describe_data(self):
        return "d"

    def shaped_as(self, config, work):
        return StubBaseLoad()


class StubBaseLoad:
    model = "t5-base-model"


@pytest.fixture
def stubbed_arms(monkeypatch):
    """gpu_quick.run with every arm stubbed: the arms it ran, in order, as (name, torch_compile, model)."""
    from bench import gpu_quick

    launched = []

    def defaults_arm(load, sizes, work, chosen, name="defaults", torch_compile=None, compile_mode=None):
        compiled = chosen.get("torch_compile", False) if torch_compile is None else torch_compile
        launched.append((name, (compiled, compile_mode) if compile_mode else compiled, load))
        rate = {"defaults": 600.0, "defaults_t5_base": 200.0}.get(name, 500.0)
        return {
            "torch_compile": compiled,
            "wall_s": 1.0,
            "median_step_s": 0.1,
            "samples_per_s": rate,
            "token_budget": 64 if name == "defaults" else sizes.token_budget,
        }

    def peer_arm(load, sizes, token_budget):
        launched.append(("peer", token_budget, load))
        return {"samples_per_s": 200.0}

    def old_recipe_arm(load, sizes):
        launched.append(("old_recipe", False, load))
        return {"samples_per_s": 50.0}

    def time_to_accuracy(device, sizes, work, token_budget, save):
        launched.append(("time_to_accuracy", token_budget, device))
        save({"arms": {"defaults": {"reached": False}}})
        save({"arms": {"defaults": {"reached": False}, "peer": {"reached": False}}, "value": None})

    def measure_norms(sizes, device, models):
        launched.append(("norms", device, models))
        return {"shapes": {model: {} for model in models}}

    def measure_sliced_loss(sizes, device, models):
        launched.append(("sliced_loss", device, models))
        return {"shapes": {model: {} for model in models}}

    monkeypatch.setattr(gpu_quick, "measure_norms", measure_norms)
    monkeypatch.setattr(gpu_quick, "measure_sliced_loss", measure_sliced_loss)
    monkeypatch.setattr(gpu_quick, "time_to_accuracy", time_to_accuracy)
    monkeypatch.setattr(gpu_quick, "defaults_arm", defaults_arm)
    monkeypatch.setattr(gpu_quick, "peer_arm", peer_arm)
    monkeypatch.setattr(gpu_quick, "old_recipe_arm", old_recipe_arm)
    monkeypatch.setattr(gpu_quick.Workload, "build", classmethod(lambda cls, *args: StubLoad()))
    monkeypatch.setattr(gpu_quick, "fast_defaults", lambda facts: {"optim": "adamw_torch_fused"})
    return launched


def test_gpu_quick_runs_the_headline_arms_first_and_saves_the_ratios_after_each(stubbed_arms, tmp_path):
    from bench import gpu_quick
    from bench.quick_arms import QuickSizes

    saved = []
    result = gpu_quick.run(
        "data", tmp_path, QuickSizes(token_budget=2048), "cuda", save=lambda r: saved.append(json.loads(json.dumps(r)))
    )
    assert [(name, detail) for name, detail, _ in stubbed_arms] == [
        ("defaults", False),
        ("peer", 64),  # the peer's batch is sized from the defaults' own token budget
        ("old_recipe", False),
        ("defaults_t5_base", False),
        ("norms", "cuda"),
        ("sliced_loss", "cuda"),
        ("time_to_accuracy", 2048),  # the token budget asked (None on a GPU: the defaults' own)
        ("defaults_double_budget", False),
        ("defaults_compiled", True),
        ("defaults_compiled_warm", True),  # with the compile cache the first compiled arm left
        ("defaults_compiled_graphs", (True, "reduce-overhead")),  # its regions replayed as CUDA graphs
    ]
    assert isinstance(stubbed_arms[3][2], StubBaseLoad) and isinstance(stubbed_arms[1][2], StubLoad)
    # The norms and the loss on the defaults' own model, t5-small's shape, and on a GPU on t5-base's too.
    assert stubbed_arms[4][2] == stubbed_arms[5][2] == ["t5-small-load", "t5-base-model"]
    assert (
        list(result["norms"]["shapes"]) == list(result["sliced_loss"]["shapes"]) == ["t5-small-load", "t5-base-model"]
    )
    assert result["arms"]["defaults_double_budget"]["token_budget"] == 2 * 64  # twice the defaults' own
    assert result["value"] == 3.0 and result["defaults_over"] == {"peer": 3.0, "old_recipe": 12.0}
    assert "peer" in result["unit"] and {"compile", "compile_warm", "compile_graphs"} <= set(result)
    # Written after each arm: a run cut short after the peer keeps the headline.
    assert "value" not in saved[0] and saved[1]["value"] == 3.0 and "old_recipe" not in saved[1]["defaults_over"]
    assert [snapshot["done"][-1] for snapshot in saved[3:8]] == [
        "defaults_t5_base",
        "norms",
        "sliced_loss",
        "time_to_accuracy defaults",
        "time_to_accuracy peer",
    ]
    assert set(result["time_to_accuracy"]["arms"]) == {"defaults", "peer"}


def test_gpu_quick_turns_torch_compile_the_other_way_only_on_a_gpu_with_the_budget_for_it(
    stubbed_arms, tmp_path, monkeypatch
):
    from bench import gpu_quick
    from bench.quick_arms import QuickSizes

    sizes = QuickSizes(token_budget=2048)
    monkeypatch.setattr(gpu_quick, "fast_defaults", lambda facts: {"torch_compile": True, "optim": "x"})
    gpu_quick.run("data", tmp_path, sizes, "cuda")
    assert [arm[:2] for arm in stubbed_arms[-2:]] == [
        ("defaults_eager", False),
        ("defaults_compiled_graphs", (True, "reduce-overhead")),
    ]
    stubbed_arms.clear()
    gpu_quick.run("data", tmp_path, sizes, "cpu")
    assert [name for name, _, _ in stubbed_arms] == [
        "defaults",
        "peer",
        "old_recipe",
        "defaults_t5_base",
        "norms",
        "sliced_loss",
        "time_to_accuracy",
    ]
    stubbed_arms.clear()
    short = gpu_quick.Budget(seconds=540, began=time.time() - 540 + gpu_quick.COMPILE_ARM_S - 10)
    result = gpu_quick.run("data", tmp_path, sizes, "cuda", budget=short)
    assert "defaults_eager" not in result["arms"] and "needed" in result["skipped"]["defaults_eager"]
    assert "compile" not in result and "defaults_compiled_graphs" in result["arms"]
    stubbed_arms.clear()
    nearly_spent = gpu_quick.Budget(seconds=540, began=time.time() - 540 + gpu_quick.DOUBLE_BUDGET_ARM_S - 10)
    result = gpu_quick.run("data", tmp_path, sizes, "cuda", budget=nearly_spent)
    assert "defaults_double_budget" not in result["arms"] and "needed" in result["skipped"]["defaults_double_budget"]
    stubbed_arms.clear()
    # Too little left for the time-to-accuracy figure, enough for the compile arm: the one skipped, the other run.
    shorter = gpu_quick.Budget(seconds=540, began=time.time() - 540 + sizes.accuracy.needs_s - 10)
    result = gpu_quick.run("data", tmp_path, sizes, "cuda", budget=shorter)
    assert "time_to_accuracy" not in result and set(result["skipped"]) == {"time_to_accuracy"}
    assert "defaults_eager" in result["arms"]
    stubbed_arms.clear()
    # Compiling where the defaults do not: enough left for the cold compiled arm, which takes what it needs, and
    # then too little for the warm one after it.
    monkeypatch.setattr(gpu_quick, "fast_defaults", lambda facts: {"optim": "x"})
    stubbed = gpu_quick.defaults_arm
    clock = [time.time()]

    def taking_its_time(load, sizes, work, chosen, name="defaults", torch_compile=None, compile_mode=None):
        clock[0] += gpu_quick.COMPILE_ARM_S if name == "defaults_compiled" else 0
        return stubbed(load, sizes, work, chosen, name, torch_compile, compile_mode)

    monkeypatch.setattr(gpu_quick, "defaults_arm", taking_its_time)
    monkeypatch.setattr(gpu_quick.time, "time", lambda: clock[0])
    both = gpu_quick.COMPILE_ARM_S + gpu_quick.COMPILE_WARM_ARM_S
    tight = gpu_quick.Budget(seconds=540, began=clock[0] - 540 + both - 10)
    result = gpu_quick.run("data", tmp_path, sizes, "cuda", budget=tight)
    assert "defaults_compiled" in result["arms"] and "needed" in result["skipped"]["defaults_compiled_warm"]
    assert "compile" in result and "compile_warm" not in result
    assert "needed" in result["skipped"]["defaults_compiled_graphs"]
    stubbed_arms.clear()
    # Too little for the cold compiled arm, enough for the CUDA-graphs one: the warm arm has no cache to take.
    graphs_only = gpu_quick.Budget(seconds=540, began=clock[0] - 540 + gpu_quick.COMPILE_ARM_S - 10)
    result = gpu_quick.run("data", tmp_path, sizes, "cuda", budget=graphs_only)
    assert result["skipped"]["defaults_compiled_warm"] == "no compiled arm left it a compile cache"
    assert [name for name, _, _ in stubbed_arms][-1] == "defaults_compiled_graphs"


def test_a_budget_says_how_long_is_left():
    from bench.gpu_quick import Budget

    assert Budget(540, began=1000.0).left(now=1100.0) == 440.0
    assert Budget(None, began=1000.0).left(now=5000.0) == float("inf")
    assert Budget(None, began=1000.0).short_of(240) is None
    assert Budget(540, began=1000.0).short_of(240, now=1340.0) == "200 s of the budget left, 240 s needed"
    assert Budget(540, began=1000.0).short_of(240, now=1300.0) is None


def test_the_table_shows_how_busy_each_arm_was_its_top_kernels_and_the_time_to_accuracy():
    from bench.quick_report import table

    def arm(rate: float, busy: float | None, full_logits: bool) -> dict:
        timeline = {
            "activity": "CUDA kernels, copies and memsets",
            "steps": 3,
            "busy_fraction": busy,
            "kernels_per_step": 2000.0,
            "top_kernels": [{"name": "sm90_xmma_gemm", "total_ms": 5.0, "calls": 90, "share_of_kernel_time": 0.25}],
        }
        return {
            "label": "x",
            "samples_per_s": rate,
            "real_tokens_per_s": 1,
            "mfu_real_tokens": 0.06,
            "peak_memory_gib": 1.0,
            "loss_vocabulary": "full",
            "full_logits": full_logits,
            "warmup_s": 1.0,
            "median_step_s": 0.06,
            "slowest_step_s": 0.2,
            "timeline": None if busy is None else timeline,
        }

    shown = table(
        {
            "device": "H200",
            "versions": {"torch": "2", "cuda": "13"},
            "model": "m",
            "arms": {"defaults": arm(600.0, 0.1834, False), "peer": arm(200.0, None, True)},
            "defaults_over": {"peer": 3.0},
            "skipped": {"defaults_compiled": "200 s of the budget left, 240 s needed"},
            "norms": {
                "shapes": {
                    "t5-small-shape": {
                        "norms_swapped": 32,
                        "arms": {
                            "t5_norms": {"median_step_ms": 30.0, "timeline": {"kernels_per_step": 3000.0}},
                            "fused_norms": {"median_step_ms": 25.0, "timeline": {"kernels_per_step": 2300.0}},
                        },
                        "t5_norms_over_fused_step": 1.2,
                    }
                }
            },
            "sliced_loss": {
                "shapes": {
                    "t5-small-shape": {
                        "target_positions": 6144,
                        "arms": {"t5_logits": {"median_step_ms": 40.0, "peak_memory_mib": 2000.0}},
                        "not_measured": "torch 2.11.0 has no linear_cross_entropy",
                    }
                }
            },
            "time_to_accuracy": {
                "target": "held-out logical-form accuracy >= 70%",
                "held_out_questions": 1000,
                "value": None,
                "arms": {
                    "defaults": {"reached": True, "training_s": 40.0, "wall_s": 55.0, "step": 700},
                    "peer": {"reached": False, "training_s": 90.0, "steps": 900, "best_lf_accuracy": 0.61},
                },
            },
        }
    )
    assert "| defaults | 600.0 | 1 | 6.00% | 18% | 1.0 | full, sliced |" in shown
    assert "| peer | 200.0 | 1 | 6.00% | n/a | 1.0 | full, logits |" in shown
    assert "defaults timeline (CUDA kernels, copies and memsets, 3 steps): 18% busy" in shown
    assert "sm90_xmma_gemm 25%" in shown and "peer timeline" not in shown
    assert "- defaults_compiled: not run (200 s of the budget left, 240 s needed)" in shown
    assert "samples/s defaults / peer: 3.0x" in shown
    assert (
        "norms (t5-small-shape, 32 norms): a step with T5's own 30.0 ms (3000.0 kernels), with torch's RMSNorm "
        "25.0 ms (2300.0); T5's over torch's: 1.2x"
    ) in shown
    assert (
        "full-vocabulary loss (t5-small-shape, 6144 target positions): t5 logits 40.0 ms, 2000.0 MiB (torch 2.11.0 "
        "has no linear_cross_entropy)"
    ) in shown
    assert "- defaults: 40.0 s of training (55.0 s with evaluations), step 700" in shown
    assert "- peer: not reached in 90.0 s of training (900 steps, best 0.61)" in shown


def test_gpu_quick_leaves_out_the_arms_it_is_told_to_skip(stubbed_arms, tmp_path):
    from bench import gpu_quick
    from bench.quick_arms import QuickSizes

    left_out = ("defaults_t5_base", "norms", "sliced_loss", "time_to_accuracy")
    sizes = QuickSizes(token_budget=2048, skip=frozenset(left_out))
    result = gpu_quick.run("data", tmp_path, sizes, "cuda")
    assert [name for name, _, _ in stubbed_arms] == [
        "defaults",
        "peer",
        "old_recipe",
        "defaults_double_budget",
        "defaults_compiled",
        "defaults_compiled_warm",
        "defaults_compiled_graphs",
    ]
    assert result["skipped"] == dict.fromkeys(left_out, "left out (--skip)")
    stubbed_arms.clear()
    gpu_quick.run("data", tmp_path, QuickSizes(token_budget=2048, skip=frozenset({"compile"})), "cuda")
    assert "defaults_compiled" not in [name for name, _, _ in stubbed_arms]
    stubbed_arms.clear()
    result = gpu_quick.run("data", tmp_path, QuickSizes(token_budget=2048, skip=frozenset({"compile_graphs"})), "cuda")
    assert [name for name, _, _ in stubbed_arms][-1] == "defaults_compiled_warm"
    assert result["skipped"] == {"defaults_compiled_graphs": "left out (--skip)"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gpu-quick", "--device", "cpu", "--smoke", "--skip", "peer,nonesuch"], "--skip nonesuch: no such arm"),
        (["--only", "train", "--skip", "peer"], "--skip leaves out arms of gpu-quick"),
    ],
)
def test_a_skip_of_no_such_arm_or_outside_gpu_quick_is_one_line_naming_the_choices(argv, message, capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
