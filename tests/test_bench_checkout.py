"""The GPU bench from a clone alone: a checkout with no ``shared`` beside it (the session's ``bench_checkout``) builds
the full-size model directories and rehearses ``bench/device.sh`` (``gpu-quick``) on the CPU, as a GPU machine given
only the tree would."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers.bench import add_site
from helpers.distributions import pins

from bench.gpu_quick import RESULT_NAME
from bench.quick_report import ARMS

# The rehearsal's budget: device.sh took 249 s on this project's 2 shared cores at a load average of 4 (three rank
# launches: the defaults, t5-base's arm, the time to accuracy's defaults); a load average of 12 made one launch
# alone take 4.5 minutes before.
REHEARSAL_BUDGET_S = 1440
# What every arm of gpu-quick records.
ARM_KEYS = (
    "label",
    "samples_per_s",
    "real_tokens_per_s",
    "mfu_real_tokens",
    "peak_memory_gib",
    "memory_measure",
    "loss_vocabulary",
    "warmup_steps",
    "timed_steps",
    "warmup_s",
    "median_step_s",
    "slowest_step_s",
    "wall_s",
    "timeline",
)


def run_in(checkout: Path, *command: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``python COMMAND`` in the copy, importing its own bench and textsql first."""
    ran = subprocess.run(
        [sys.executable, *command],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    return ran


@pytest.mark.parametrize(
    "config, shape",
    [
        ("T5_SMALL_CONFIG", [512, 2048, 64, 6, 6, 8, 32128]),
        # t5-base's published dimensions: d_model 768, d_ff 3072, d_kv 64, 12 + 12 layers, 12 heads.
        ("T5_BASE_CONFIG", [768, 3072, 64, 12, 12, 12, 32128]),
    ],
)
def test_the_full_size_model_directories_are_built_from_a_checkout_alone(bench_checkout, tmp_path, config, shape):
    """The full-size GPU bench trains t5-small's shape and t5-base's: their directories come from the package, not
    ../shared."""
    script = (
        "import json, sys; from pathlib import Path; import bench; from bench import profiles; "
        "from textsql.model import builds_from_config, load_config, load_tokenizer; "
        f"built = profiles.model_dir(Path(sys.argv[1]), profiles.{config}); config = load_config(built); "
        "print(json.dumps({'bench': bench.__file__, 'directory': str(built), 'from_config': builds_from_config(built), "
        "'shape': [config.d_model, config.d_ff, config.d_kv, config.num_layers, config.num_decoder_layers, "
        "config.num_heads, config.vocab_size], 'tokens': len(load_tokenizer(built))}))"
    )
    built = json.loads(run_in(bench_checkout, "-c", script, str(tmp_path), timeout=300).stdout.splitlines()[-1])
    assert Path(built["bench"]).is_relative_to(bench_checkout)
    assert built["shape"] == shape and built["tokens"] == 32100 and built["from_config"]


def linked_python(root: Path) -> Path:
    """A fresh virtual environment that sees this one's packages through a .pth: device.sh's pip finds every pin
    satisfied there, and anything it did install would land in the new environment, never in this one."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    add_site(python, sysconfig.get_path("purelib"), "this-environment")
    return python


@pytest.mark.slow
@pytest.mark.timeout(1560)  # past the suite's 900 s, so the run's own bound fires first
def test_device_script_rehearses_gpu_quick_on_the_cpu_from_a_checkout_alone(bench_checkout, tmp_path):
    """``QUICK_ARGS="--device cpu --smoke" bash bench/device.sh OUT`` from the copy, as on a GPU machine: every arm
    but the GPU-only one, in the order a cut-short run keeps the most telling, on the full-vocabulary loss, every
    figure, a timeline each, the time to accuracy, the budget spent after each."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pin = pins(bench_checkout / "bench" / "gpu-requirements.txt")["deepspeed"]
    (wheels / f"deepspeed-{pin}.tar.gz").write_bytes(b"")  # every pin is installed: pip never opens it
    env = {
        **os.environ,
        "PYTHON": str(linked_python(tmp_path)),
        "WHEELS": str(wheels),
        "BUDGET_S": str(REHEARSAL_BUDGET_S),
        "QUICK_ARGS": f"--device cpu --smoke --work {tmp_path / 'work'}",
        "PIP_CONFIG_FILE": os.devnull,
    }
    ran = subprocess.run(
        ["bash", "bench/device.sh", str(tmp_path / "out")],
        cwd=bench_checkout,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=REHEARSAL_BUDGET_S + 60,
    )
    log = tmp_path / "out" / "gpu-quick.log"
    assert ran.returncode == 0, ran.stdout[-4000:] + (log.read_text()[-4000:] if log.is_file() else ran.stderr)
    assert f"of the {REHEARSAL_BUDGET_S} s budget" in (tmp_path / "out" / "device.log").read_text()
    result = json.loads((tmp_path / "out" / RESULT_NAME).read_text())
    assert list(result["arms"]) == ["defaults", "peer", "old_recipe", "defaults_t5_base"]  # no GPU: no compile arm
    assert set(result["arms"]) < set(ARMS)
    for name, arm in result["arms"].items():
        assert set(ARM_KEYS) <= set(arm), (name, set(ARM_KEYS) - set(arm))
        assert arm["samples_per_s"] > 0 and arm["mfu_real_tokens"] > 0 and arm["peak_memory_gib"] > 0, (name, arm)
        assert arm["loss_vocabulary"] == "full" and arm["timed_steps"] == 2, (name, arm)
        # The defaults' ranks compute that loss in slices; the peer and the old recipe build T5's logits.
        assert arm["full_logits"] == (not name.startswith("defaults")), (name, arm)
        # One step profiled after the timed ones, on the CPU's activity where no GPU is.
        timeline = arm["timeline"]
        assert timeline["steps"] == 1 and timeline["activity"].startswith("CPU"), (name, timeline)
        assert 0 < timeline["busy_fraction"] <= 1 and timeline["top_kernels"][0]["name"].startswith("aten::"), name
    assert result["value"] == result["defaults_over"]["peer"] > 0 and result["defaults_over"]["old_recipe"] > 0
    assert result["device"] == "cpu" and result["machine"]["cores"] and "peer" in result["unit"]
    assert result["arms"]["peer"]["batch"] % 8 == 0
    for row in ("| defaults |", "| peer |", "| old_recipe |", "| defaults_t5_base |", "| real tokens/s |"):
        assert row in ran.stdout, row
    assert "defaults / peer: " in ran.stdout and "defaults / old recipe: " in ran.stdout
    assert "defaults timeline (CPU" in ran.stdout and "gpu-quick: arm peer done; " in ran.stdout
    # Time to accuracy: both arms trained and evaluated on the held-out questions, far from the target at this size.
    accuracy = result["time_to_accuracy"]
    assert accuracy["held_out_questions"] == 16 and accuracy["value"] is None
    assert accuracy["not_reached"] == ["defaults", "peer"]
    for name, arm in accuracy["arms"].items():
        assert arm["steps"] == 2 and arm["evaluations"] >= 2 and arm["best_lf_accuracy"] is not None, (name, arm)
    assert "- defaults: not reached in" in ran.stdout and "gpu-quick: arm time_to_accuracy peer done; " in ran.stdout
    # T5's norms against torch's RMSNorm in the same steps: torch's dispatches fewer operators a step.
    (shape, norms), *more = result["norms"]["shapes"].items()  # no GPU: the defaults' model alone
    own, fused = (norms["arms"][name]["timeline"]["kernels_per_step"] for name in ("t5_norms", "fused_norms"))
    assert shape == "t5-tiny" and not more and norms["norms_swapped"] > 0 and fused < own, norms
    assert "norms (t5-tiny, " in ran.stdout and "gpu-quick: arm norms done; " in ran.stdout
    # The full-vocabulary loss three ways in the same steps: the defaults' slices allocate less than T5's logits.
    (shape, loss), *more = result["sliced_loss"]["shapes"].items()
    assert shape == "t5-tiny" and not more and set(loss["arms"]) == {"t5_logits", "torch_slices", "our_slices"}
    assert loss["arms"]["our_slices"]["peak_memory_mib"] < loss["arms"]["t5_logits"]["peak_memory_mib"], loss
    assert "full-vocabulary loss (t5-tiny, " in ran.stdout and "gpu-quick: arm sliced_loss done; " in ran.stdout
    # The rank's log comes back with the results, as it would from a GPU machine.
    assert (tmp_path / "out" / "logs" / "gpu-quick-defaults" / "bench.log").is_file()
    # The rank trained the copy's model, not the worktree's.
    assert (
        str(bench_checkout / "textsql" / "assets" / "t5-tiny")
        in (tmp_path / "work" / "gpu-quick-defaults" / "bench.log").read_text()
    )
