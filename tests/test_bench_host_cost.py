"""python -m bench host-cost (bench/host_cost.py): what the host spends issuing a training step, T5 against a rank's."""

import json

from bench import host_cost
from bench.profiles import T5_SMALL_CONFIG


def test_the_host_cost_figure_steps_every_arm_narrowed_and_counts_what_each_dispatches(tmp_path):
    out = tmp_path / "host_cost.json"
    assert host_cost.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (figure,) = result["shapes"].values()
    assert figure["model"] == "t5-tiny" and result["width"]["d_model"] == 32
    arms = figure["arms"]
    assert list(arms) == list(host_cost.ARMS)
    assert all(
        arm["median_step_ms"] > 0 and arm["step_ms_range"][0] <= arm["step_ms_range"][1] for arm in arms.values()
    )
    # A rank's changes dispatch fewer operators than T5; the copies replace each layer's two casts a forward with two
    # multi-tensor copies, so they compute less again.
    assert arms["rank"]["compute_ops"] < arms["rank_without_weight_copies"]["compute_ops"] < arms["t5"]["compute_ops"]
    for arm in arms.values():  # a profiled step's time, split between its top-level operators and the rest
        assert arm["in_operators_ms"] > 0 and arm["around_operators_ms"] > 0
        assert abs(arm["in_operators_ms"] + arm["around_operators_ms"] - arm["profiled_step_ms"]) <= 0.011
    assert figure["over_t5_step"]["t5"] == 1.0
    ratio = arms["rank"]["median_step_ms"] / arms["t5"]["median_step_ms"]
    assert abs(figure["over_t5_step"]["rank"] - ratio) < 0.001
    assert "1 torch thread" in result["method"]


def test_a_narrowed_model_keeps_the_structure_and_only_the_widths_change(tmp_path):
    narrowed = host_cost.narrow(T5_SMALL_CONFIG.parent, tmp_path)
    original = json.loads(T5_SMALL_CONFIG.read_text())
    config = json.loads((narrowed / "config.json").read_text())
    assert {key for key in config if config[key] != original.get(key)} == set(host_cost.WIDTH)
    assert (config["num_layers"], config["num_decoder_layers"], config["num_heads"]) == (6, 6, 8)
