"""The demo's scores over seeds (bench/demo_seeds.py): the spread it reports and the bar its worst seed must clear."""

from __future__ import annotations

import pytest

from bench.demo_seeds import BAR, main, spread


def run(lf: float, ex: float, where: float, wall_s: float = 400.0, real_lf: float | None = 0.07) -> dict:
    return {"lf": lf, "ex": ex, "where": where, "wall_s": wall_s, "real_lf": real_lf}


def test_the_spread_is_the_mean_and_range_of_each_figure_over_the_seeds():
    figures = spread([run(0.714, 0.753, 0.755, 440.0), run(0.684, 0.728, 0.735, 452.0), run(0.73, 0.77, 0.78, 431.0)])
    assert figures["lf"] == {"mean": 0.7093, "min": 0.684, "max": 0.73}
    assert figures["wall_s"] == {"mean": 441.0, "min": 431.0, "max": 452.0}
    assert figures["every_seed_clears_the_bar"] is False  # the second seed: LF 68.4 %, where 73.5 %


def test_the_bar_holds_only_when_the_worst_seed_clears_every_score():
    clearing = [run(BAR["lf"], BAR["ex"], BAR["where"]), run(0.8, 0.8, 0.8)]
    assert spread(clearing)["every_seed_clears_the_bar"] is True
    assert spread([*clearing, run(0.8, 0.8, BAR["where"] - 0.001)])["every_seed_clears_the_bar"] is False


def test_a_figure_missing_from_every_run_is_left_out_and_none_are_refused():
    assert "real_lf" not in spread([run(0.7, 0.7, 0.75, real_lf=None)])
    with pytest.raises(ValueError, match="pass at least one seed"):
        spread([])


def test_a_repeated_seed_is_refused_before_any_demo_runs(capsys):
    with pytest.raises(SystemExit):
        main(["--seeds", "42", "1", "42"])
    assert "--seeds 42 1 42 repeats a seed; give each once" in capsys.readouterr().err


@pytest.mark.parametrize("param", ["learning_rate", "seed=7", "max_steps=10"])
def test_an_arm_parameter_without_a_value_or_naming_the_seed_or_steps_is_refused_before_any_demo_runs(capsys, param):
    with pytest.raises(SystemExit):
        main(["--seeds", "1", "--param", param])
    assert f"--param {param!r}: give NAME=VALUE" in capsys.readouterr().err
