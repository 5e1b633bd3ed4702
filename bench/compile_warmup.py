"""What torch.compile costs a run before its training settles, on this machine: the whole model against its regions
(:mod:`textsql.training.compiling`), each with a cold and a warm compile cache, against the same run eager.

``python -m bench compile-warmup`` launches five runs of ``textsql launch --ranks 1`` one after the other
(:func:`bench.ours.launch_ours`, the ranks under :mod:`bench.rank_probe`), on a model of t5-small's shape (random
weights) with the full-vocabulary loss and the shipped sample resampled: eager; compiled whole (accelerate's
``engine.compile``, ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=false``) with an empty compile cache, then again
with the cache that run left; compiled by regions (the rank's own choice under ``--torch-compile true``), cold, then
warm. Each cache is a directory of this run's own (``TORCHINDUCTOR_CACHE_DIR``), so nothing compiled before counts.
For each run: the first step's seconds (where compilation falls), the warm-up's, the median step after it, the
graphs dynamo compiled and how many of them came after the warm-up (:func:`bench.steps.compilations_after`), and
the launch's wall time. It also counts the operators one training step dispatches with and without T5's
generation cache (:func:`step_operators`), which the trainer leaves out of every training step.

Writes ``bench/compile_warmup.json`` (``--out``). ``--smoke``: the embedded small T5 and a few steps (the tests).
On a GPU the same command measures the GPU (``--device cuda``); the committed file is this CPU's.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.fullscale import prepare_data
from bench.machine import figure_arguments, write_figure
from bench.ours import launch_ours, probe_record
from bench.setup_cost import BENCH_DIR
from bench.steps import compilations_after, step_times
from bench.workload import Workload, versions
from textsql.training.compiling import CACHE_VAR, REGIONAL_VAR

RESULT = BENCH_DIR / "compile_warmup.json"
# name: (torch.compile, by regions, the cache directory's name); the warm runs reuse the cold run's directory.
ARMS = {
    "eager": (False, None, None),
    "whole_cold": (True, False, "whole"),
    "whole_warm": (True, False, "whole"),
    "regional_cold": (True, True, "regional"),
    "regional_warm": (True, True, "regional"),
}


@dataclass(frozen=True)
class Sizes:
    """How much each run trains."""

    steps: int = 16
    warmup_steps: int = 3  # the first steps: compilation, and the recompilations of shapes first seen
    token_budget: int = 2048
    questions: int = 4000
    tiny_model: bool = False


SMOKE = Sizes(steps=3, warmup_steps=1, token_budget=512, questions=200, tiny_model=True)


def run_arm(load: Workload, sizes: Sizes, work: Path, name: str) -> dict:
    """One launch of arm ``name`` (:data:`ARMS`) and what its steps did.

    :rtype: dict
    """
    compiled, regional, cache = ARMS[name]
    env = {} if not compiled else {REGIONAL_VAR: str(regional).lower(), CACHE_VAR: str(work / f"cache-{cache}")}
    began = time.monotonic()
    run_dir = launch_ours(
        work,
        name.replace("_", "-"),
        load.model,
        load.data,
        probe_env=env,
        max_steps=sizes.steps,
        eval_strategy="no",
        report_to="none",
        max_tokens_per_batch=sizes.token_budget,
        torch_compile=compiled,
    )
    wall = time.monotonic() - began
    record = probe_record(run_dir)
    return {
        "torch_compile": compiled,
        "regional": regional,
        "cache": None if cache is None else ("warm" if name.endswith("_warm") else "cold"),
        "first_step_s": round(record["step_ended"][0] - record["step_began"][0], 2),
        **step_times(record, sizes.warmup_steps),
        "graphs_compiled": record["graphs_compiled"][-1],
        "compilations_after_warmup": compilations_after(record, sizes.warmup_steps),
        "launch_wall_s": round(wall, 1),
    }


class _Count(TorchDispatchMode):
    """Counts the ATen operators dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def step_operators(model_dir: Path) -> dict:
    """ATen operators one training forward and backward of ``model_dir``'s model dispatches (a batch of 16
    questions of 96 tokens, queries of 24), with T5's generation cache (its config's default) and without it (what
    the trainer passes).

    :rtype: dict
    """
    from textsql.model import load_model

    torch.manual_seed(0)
    model = load_model(str(model_dir)).train()
    inputs = {"input_ids": torch.randint(2, 1000, (16, 96)), "labels": torch.randint(2, 1000, (16, 24))}
    counts = {}
    for name, extra in (("with_generation_cache", {}), ("without", {"use_cache": False})):
        with _Count() as counted:
            model(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), **extra).loss.backward()
        counts[name] = counted.count
    return counts


def measure(sizes: Sizes, work: Path, device: str) -> dict:
    """Every arm, then the figures against eager and against the whole model's.

    :rtype: dict
    """
    load = Workload.build(prepare_data(work, "schema"), work, device, sizes.tiny_model, sizes.questions)
    arms = {}
    for name in ARMS:
        arms[name] = run_arm(load, sizes, work, name)
        print(f"{name}: {arms[name]}", flush=True)
    first = {name: arm["first_step_s"] for name, arm in arms.items()}
    return {
        "figure": "compile-warmup",
        "device": load.device_name,
        "model": load.model_label,
        "data": load.describe_data(),
        "sizes": asdict(sizes),
        "arms": arms,
        "first_step_over_eager": {name: round(first[name] / first["eager"], 1) for name in arms if name != "eager"},
        "regional_over_whole_first_step": {
            cache: round(first[f"regional_{cache}"] / first[f"whole_{cache}"], 2) for cache in ("cold", "warm")
        },
        "warm_over_cold_first_step": {
            kind: round(first[f"{kind}_warm"] / first[f"{kind}_cold"], 2) for kind in ("whole", "regional")
        },
        "median_step_over_eager": {
            name: round(arm["median_step_s"] / arms["eager"]["median_step_s"], 2)
            for name, arm in arms.items()
            if name != "eager"
        },
        "step_operators": step_operators(load.model),
        "versions": versions(),
        "method": (
            f"textsql launch --ranks 1 on {load.device_name}, {sizes.steps} steps at a token budget of "
            f"{sizes.token_budget}, the full-vocabulary loss; first_step_s: the first optimizer step's wall time; "
            f"warmup_s: the first {sizes.warmup_steps} steps'; median_step_s: of the steps after them; "
            "graphs_compiled: dynamo's count at the run's end; compilations_after_warmup: graphs compiled after the "
            "warm-up; each compiled pair shares a TORCHINDUCTOR_CACHE_DIR that starts empty; step_operators: ATen "
            "operators of one forward and backward, counted with a TorchDispatchMode"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = figure_arguments(argv, "compile-warmup", __doc__ or "", RESULT)
    work = Path(tempfile.mkdtemp(prefix="compile-warmup-"))
    try:
        result = measure(SMOKE if args.smoke else Sizes(), work, args.device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_figure(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
