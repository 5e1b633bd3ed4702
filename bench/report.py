"""Write a bench run as ``results.json`` and a markdown table (``README.md``)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# Figure keys in reading order, and their labels in the table.
FIGURES = {
    "train_speedup_dynamic_padding": "Training samples/s, per-batch padding + length grouping over fixed 96 padding",
    "infer_speedup_batched": "Inference examples/s, batched (64, mask, length-sorted) over one question at a time",
    "rendezvous_64_workers_s": "Rendezvous of 64 concurrent register-only workers, first connection to hostfile",
    "rendezvous_256_workers_s": "Rendezvous of 256 concurrent register-only workers, first connection to hostfile",
    "rendezvous_64_agents_end_to_end_s": "64 real register-only agent processes, start_workers call to hostfile",
    "prepare_examples_per_s": "Tokenizing the sample with batched datasets.map (examples/s)",
    "startup_to_first_step_s": "Start-up, `textsql launch` to the first training step done",
}
PROFILES_KEY = "deepspeed_profiles"

# Why a goal can be missed and what would move it, shown under the table when it is.
MISSED = {
    "train_speedup_dynamic_padding": (
        "The speed-up is the ratio of padded tokens (see tokens_per_example in results.json) diluted by what does not "
        "scale with sequence length: the 32k-entry output projection and softmax per target token, the optimizer step, "
        "and the trainer's per-step overhead, which weigh most on a model this small. Longer fixed padding (the seed's "
        "96 against ~20-token questions), a larger model, or a bigger batch move it up."
    ),
    "infer_speedup_batched": (
        "Batching gains by running 64 questions per decoder step; on 2 shared cores the per-step matrix work grows with "
        "the batch, so the gain is bounded by how much of a batch-1 step is Python and kernel-launch overhead. On a GPU "
        "or with more cores the batched arm scales further; fewer threads per process contending would help here."
    ),
    "rendezvous_64_workers_s": (
        "Registration is one short HMAC-authenticated exchange per worker handled by a thread each; the time goes to "
        "thread scheduling on the shared cores. Fewer competing processes, or a selector-based server, would move it."
    ),
}


def write(results: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``results.json`` and ``README.md`` into ``out_dir`` (each through a temporary file and a rename).

    :rtype: tuple[pathlib.Path, pathlib.Path]
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "results.json", out_dir / "README.md"
    for path, text in zip(paths, (json.dumps(results, indent=2) + "\n", markdown(results))):
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    return paths


def markdown(results: dict) -> str:
    """The README: machine, releases, one row per figure with how it was measured, the profiles table, notes.

    :rtype: str
    """
    machine, releases = results["machine"], results["releases"]
    lines = [
        "# Benchmarks",
        "",
        "`make bench` (`.venv/bin/python -m bench`) writes this file and `results.json` from one run. Each comparison runs "
        "both arms in the same process, alternated, and reports the ratio of medians: the machine is shared, so absolute "
        "numbers are noisy and the ratios are what count. `python -m bench --only FIGURE[,FIGURE]` re-measures some "
        "figures and keeps the others.",
        "",
        f"Run: {results['started']} to {results['finished']} UTC.",
        "",
        "| machine | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in machine.items()],
        "",
        "| release | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in releases.items()],
        "",
        "| figure | key | value | goal | how it was measured |",
        "|---|---|---|---|---|",
    ]
    for key, label in FIGURES.items():
        figure = results.get(key)
        if figure:
            goal = figure.get("goal") or ""
            lines.append(f"| {label} | `{key}` | {_value(key, figure)} | {goal} | {figure['method']} |")
    profiles = results.get(PROFILES_KEY)
    if profiles:
        lines += [
            "",
            f"## DeepSpeed profiles on 2 CPU ranks (`{PROFILES_KEY}`)",
            "",
            profiles["method"] + ".",
            "",
            "| profile | samples/s | vs zero0 | peak RSS GiB/rank (max) | vs zero0 | estimate GPU GB/rank | estimate vs zero0 | estimate GPU+CPU per rank vs zero0 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, row in profiles["profiles"].items():
            lines.append(
                f"| {name} | {row['samples_per_s']} | {row['samples_per_s_vs_zero0']} | {row['peak_rss_gib_max_rank']} | "
                f"{row['peak_rss_vs_zero0']} | {row['estimate_gpu_gb_per_rank']} | {row['estimate_gpu_vs_zero0']} | {row['estimate_ram_vs_zero0']} |"
            )
    notes = [f"- `{key}` missed its goal ({results[key]['goal']}): {why}" for key, why in MISSED.items() if key in results and not _met(results[key])]
    notes += [f"- {note}" for note in results.get("notes", [])]
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def _value(key: str, figure: dict) -> str:
    if key == "prepare_examples_per_s":
        parts = []
        for name in ("sample", "dev_questions"):
            if name in figure:
                part = figure[name]
                parts.append(
                    f"{name} ({part['examples']}, {part['tokenized']}): batched map {part['batched_map']['median']}/s, "
                    f"per-example loop {part['per_example_loop']['median']}/s, tokenizer on batches alone "
                    f"{part['batched_tokenizer_call_only']['median']}/s; map over loop {part['speedup']}x"
                )
        return "<br>".join(parts)
    return f"{figure['value']} {figure['unit']}"


def _met(figure: dict) -> bool:
    goal = figure.get("goal")
    if not goal:
        return True
    operator, bound = goal.split()
    return figure["value"] >= float(bound) if operator == ">=" else figure["value"] <= float(bound)
