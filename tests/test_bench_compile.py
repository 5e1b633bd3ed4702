"""python -m bench compile-warmup (bench/compile_warmup.py): its arms, its ratios and its operator count, with the
launches stubbed (the committed bench/compile_warmup.json is a real run: ten minutes of this machine)."""

import json

from bench import compile_warmup
from textsql.constants import DEFAULT_MODEL_DIR


def test_compile_warmup_runs_every_arm_and_compares_their_first_steps(tmp_path, monkeypatch):
    first_steps = {"eager": 3.0, "whole_cold": 150.0, "whole_warm": 40.0, "regional_cold": 75.0, "regional_warm": 15.0}
    ran = []

    class Load:
        device_name, model_label, model = "cpu", "stub", DEFAULT_MODEL_DIR

        def describe_data(self):
            return "stub data"

    def run_arm(load, sizes, work, name):
        ran.append(name)
        return {"first_step_s": first_steps[name], "median_step_s": 3.0 if name == "eager" else 3.3}

    monkeypatch.setattr(compile_warmup, "run_arm", run_arm)
    monkeypatch.setattr(compile_warmup, "prepare_data", lambda work, form: "data")
    monkeypatch.setattr(compile_warmup.Workload, "build", classmethod(lambda cls, *args: Load()))
    out = tmp_path / "compile_warmup.json"
    assert compile_warmup.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert ran == list(compile_warmup.ARMS)
    assert result["regional_over_whole_first_step"] == {"cold": 0.5, "warm": 0.38}
    assert result["warm_over_cold_first_step"] == {"whole": 0.27, "regional": 0.2}
    assert (
        result["first_step_over_eager"]["whole_cold"] == 50.0 and result["median_step_over_eager"]["whole_warm"] == 1.1
    )
    # One training step of the embedded T5, counted for real: the generation cache costs operators, nothing else.
    operators = result["step_operators"]
    assert operators["with_generation_cache"] > operators["without"] > 0


def test_each_compiled_arm_pair_shares_a_cache_of_the_runs_own(tmp_path, monkeypatch):
    launched = []

    def launch_ours(work, name, model, data, probe_env, **values):
        launched.append((name, probe_env, values["torch_compile"]))
        return tmp_path

    record = {"step_began": [0.0, 10.0, 11.0], "step_ended": [9.0, 10.5, 11.5], "graphs_compiled": [5, 5, 5]}
    monkeypatch.setattr(compile_warmup, "launch_ours", launch_ours)
    monkeypatch.setattr(compile_warmup, "probe_record", lambda run_dir: record)

    class Load:
        model = data = tmp_path

    arms = {name: compile_warmup.run_arm(Load(), compile_warmup.SMOKE, tmp_path, name) for name in compile_warmup.ARMS}
    caches = {name: env.get(compile_warmup.CACHE_VAR) for name, env, _ in launched}
    assert caches["whole-cold"] == caches["whole-warm"] != caches["regional-cold"] == caches["regional-warm"]
    assert caches["eager"] is None and all(cache.startswith(str(tmp_path)) for cache in caches.values() if cache)
    assert [env.get(compile_warmup.REGIONAL_VAR) for _, env, _ in launched] == [None, "false", "false", "true", "true"]
    assert arms["regional_warm"]["cache"] == "warm" and arms["whole_cold"]["first_step_s"] == 9.0
    assert arms["eager"]["compilations_after_warmup"] == 0
