"""python -m bench sliced-loss (bench/sliced_loss.py): the full-vocabulary loss with T5's logits, in torch's
slices and in ours, in the same training steps."""

import json

import pytest

from bench import sliced_loss


def test_the_figure_computes_one_loss_three_ways_and_the_slices_allocate_less_than_the_logits(tmp_path):
    out = tmp_path / "sliced_loss.json"
    assert sliced_loss.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (figure,) = result["shapes"].values()
    assert figure["model"] == "t5-tiny" and "not_measured" not in figure
    arms = figure["arms"]
    assert set(arms) == set(sliced_loss.ARMS)
    # The same loss whichever way it is computed.
    assert arms["torch_slices"]["loss"] == pytest.approx(arms["t5_logits"]["loss"], rel=1e-5)
    assert arms["our_slices"]["loss"] == pytest.approx(arms["t5_logits"]["loss"], rel=1e-5)
    # 32 questions of 16 target positions: T5's step holds its fp32 logits, (512, 32128), several times over; ours
    # never holds them whole, its peak (a slice's logits and the output weight's gradient, inside torch's operator,
    # which the measure sees) below one copy.
    logits, ours = arms["t5_logits"]["peak_memory_mib"], arms["our_slices"]["peak_memory_mib"]
    one_copy = figure["target_positions"] * 32128 * 4 / 2**20
    assert figure["target_positions"] == 512
    assert 0 < ours < one_copy and logits > 2 * one_copy
    assert figure["t5_logits_over_our_slices"]["peak_memory"] == round(logits / ours, 2)
    assert all(arm["median_step_ms"] > 0 for arm in arms.values())
    assert result["releases"]["torch"] and "alternating" in result["method"]


def test_a_torch_without_linear_cross_entropy_measures_the_logits_alone_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delattr("torch.nn.functional.linear_cross_entropy")
    out = tmp_path / "sliced_loss.json"
    assert sliced_loss.main(["--smoke", "--out", str(out)]) == 0
    (figure,) = json.loads(out.read_text())["shapes"].values()
    assert list(figure["arms"]) == ["t5_logits"] and "has no linear_cross_entropy" in figure["not_measured"]
    assert not [key for key in figure if key.endswith("_over_our_slices")]
