"""The encoder-decoder FLOP convention against the issue's t5-small figures (from t5-small's real config)."""

import pytest
from transformers import AutoConfig

from bench.flops import T5Shape, mfu, peak_flops, training_flops


@pytest.fixture(scope="module")
def t5_small(shared_data_dir) -> T5Shape:
    return T5Shape.from_config(AutoConfig.from_pretrained(shared_data_dir / "t5" / "t5-small.config.json"))


def test_parameters_per_token_match_the_issue(t5_small):
    assert round(t5_small.encoder_parameters_per_token / 1e6, 1) == 22.0
    assert round(t5_small.decoder_parameters_per_token / 1e6, 1) == 38.5


def test_a_wikisql_sample_costs_13_9_gflop(t5_small):
    assert round(training_flops(t5_small, 65, 22) / 1e9, 1) == 13.9
    # The parameter term alone, 6 x (22.0M x 65 + 38.5M x 22):
    assert training_flops(t5_small, 65, 22, attention=False) == pytest.approx(6 * (22.0e6 * 65 + 38.5e6 * 22), rel=2e-3)


def test_one_percent_of_an_h100_is_about_710_samples_per_second(t5_small):
    sample = training_flops(t5_small, 65, 22)
    peak = peak_flops("NVIDIA H100 80GB HBM3")
    assert peak == 989e12
    assert 705 <= 0.01 * peak / sample <= 715
    assert mfu(1779 * sample, 1.0, peak) == pytest.approx(0.025, abs=0.0005)


def test_an_unknown_device_has_no_mfu():
    assert peak_flops("Some GPU") is None and mfu(1e12, 1.0, None) is None


def test_the_peak_is_the_exact_cards_not_the_chips():
    """Every H100 got the SXM peak when names were matched by substring; the PCIe card is 756 TFLOP/s."""
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-40GB") == peak_flops("NVIDIA A100 80GB PCIe") == 312e12
    assert peak_flops("NVIDIA L4") == 121e12 and peak_flops("NVIDIA L40S") == 362e12
    assert peak_flops("H100") is None
    assert peak_flops("cpu", cpu_cores=2) == 2 * 64e9
