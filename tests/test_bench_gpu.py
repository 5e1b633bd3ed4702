"""The GPU bench section: its arithmetic on the CPU, its clean absence without CUDA, the real thing marked gpu."""

import json
import subprocess
import sys

import pytest

from bench.flops import T5Shape, training_flops
from bench.gpu import available, curves_match, step_samples
from textsql.constants import PROJECT_DIR
from textsql.training.batching import TokenBudgetBatchSampler

TINY = T5Shape(d_model=8, d_attention=8, d_ff=16, encoder_layers=1, decoder_layers=1, vocab_size=32)


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
    assert len(steps) == 2 * per_epoch and sum(n for n, _ in steps) == 400
    total_flops = sum(training_flops(TINY, s, t) for s, t in zip(*lengths))
    assert sum(f for _, f in steps) == pytest.approx(2 * total_flops)
    assert step_samples(lengths, 512, TINY, 3) == steps[:3]


@pytest.mark.skipif(available(), reason="this machine has CUDA: the section is measured instead")
def test_without_cuda_the_gpu_section_is_skipped_and_nothing_else_changes(tmp_path):
    before = json.loads((PROJECT_DIR / "bench" / "results.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps(before))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--only",
            "gpu",
            "--out",
            str(tmp_path),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=PROJECT_DIR,
        check=True,
        timeout=300,
        capture_output=True,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert "gpu" not in results
    figures = [key for key in before if key not in ("machine", "releases", "started", "finished")]
    assert figures and all(results[key] == before[key] for key in figures)


@pytest.mark.gpu
@pytest.mark.slow
def test_the_gpu_section_runs_at_smoke_size(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--only",
            "gpu",
            "--out",
            str(tmp_path),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=PROJECT_DIR,
        check=True,
        timeout=900,
        capture_output=True,
    )
    figure = json.loads((tmp_path / "results.json").read_text())["gpu"]
    assert figure["old_recipe_samples_per_s"] > 0 and figure["profiles"]["default"]["samples_per_s"] > 0
    assert figure["device"] and figure["versions"]["cuda"]
