"""A pipeline's record (pipeline.json) as its notebooks would leave it, for the tests of what a continuation does."""

from __future__ import annotations

from pathlib import Path

from textsql.pipeline.demo import demo_parameters
from textsql.pipeline.manifest import Manifest, effective_parameters, outputs
from textsql.pipeline.parameters import NOTEBOOKS


def record(manifest: Manifest, chosen: dict, name: str, completed: bool = True) -> None:
    """What a run of ``name`` records, with the outputs a completed one leaves made real."""
    parameters = effective_parameters(name, chosen[name])
    executed = manifest.run_dir / "notebooks" / f"{name}.ipynb"
    executed.parent.mkdir(parents=True, exist_ok=True)
    executed.write_text("{}")
    manifest.started(name, parameters, executed)
    if completed:
        for path in outputs(name, parameters):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
    manifest.finished(name, completed)


def actions(steps: dict) -> list[str]:
    return [steps[name].action for name in NOTEBOOKS]


def finished_demo(out: Path) -> tuple[Manifest, dict]:
    chosen = demo_parameters(out)
    manifest = Manifest(out)
    for name in NOTEBOOKS:
        record(manifest, chosen, name)
    return Manifest.load(out), chosen
