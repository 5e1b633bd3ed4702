"""Write a bench run as ``results.json`` and a markdown table (``README.md``)."""

from __future__ import annotations

import logging
from pathlib import Path

from textsql.json_files import write_json
from worker.files import atomic_write

logger = logging.getLogger(__name__)

# Figure keys in reading order, and their labels in the table.
FIGURES = {
    "train_speedup_dynamic_padding": "Training samples/s, per-batch padding + length grouping over fixed 96 padding",
    "infer_speedup_batched": "Inference examples/s, batched (64, mask, length-sorted) over one question at a time",
    "infer_constrained_over_free": "Batched inference questions/s, constrained to each table's WikiSQL grammar over free decoding",
    "rendezvous_64_workers_s": "Rendezvous of 64 concurrent register-only workers, first connection to hostfile",
    "rendezvous_256_workers_s": "Rendezvous of 256 concurrent register-only workers, first connection to hostfile",
    "rendezvous_64_agents_end_to_end_s": "64 real register-only agent processes, start_workers call to hostfile",
    "prepare_examples_per_s": "Tokenizing the sample with batched datasets.map (examples/s)",
    "startup_to_first_step_s": "Start-up, `textsql launch` to the first training step done",
    "recovery_local_downtime_s": "A rank SIGKILLed on one of two `local` pods: downtime, kill to the resumed run's first step",
    "recovery_shrink_downtime_s": "A pod of three killed, no replacement: downtime, kill to the first step on the two left",
    "checkpoint_store": "Checkpoint store (S3 on loopback): step time with the store over without; uploads and resume",
    "gpu": "One CUDA GPU: training samples/s of the defaults over the old notebook's recipe (details in results.json)",
}
PROFILES_KEY = "deepspeed_profiles"
STEP_OPS_KEY = "step_ops"

# Why a goal can be missed and what would move it, shown under the table when it is.
MISSED = {
    "train_speedup_dynamic_padding": (
        "Per-batch padding cuts the tokens per example about fivefold (tokens_per_example_source_plus_target in "
        "results.json), but a step also has costs that do not shrink with the sequence: the AdamW update of every "
        "parameter (the 32k x 128 embedding is most of this small model), the trainer's and collator's per-step Python, "
        "and, on this machine, waiting for a core. A larger batch or model (more work per step that scales with length) "
        "or a dedicated machine moves it up; the CPU-time ratio (value_cpu_time) removes the waiting."
    ),
    "infer_speedup_batched": (
        "Batching turns 64 questions x N decoder steps into N steps of 64. On two shared CPU cores the arithmetic of a "
        "step grows almost linearly with the batch once the cores are busy, so the gain is mostly the per-step overhead "
        "of generate (Python, cache bookkeeping, kernel dispatch) that batch 1 pays 64 times. On a GPU, where a step of "
        "64 costs about what a step of 1 does, it grows well past 8; here a quieter machine moves it (see value_cpu_time)."
    ),
    "rendezvous_64_workers_s": (
        "Each registration is one short HMAC-authenticated exchange handled by its own thread; the time goes to thread "
        "scheduling on the shared cores. Fewer competing processes, or a selector-based server, would move it."
    ),
}


def observations(results: dict) -> list[str]:
    """Findings worth reading beside the table, from the numbers themselves.

    :rtype: list[str]
    """
    notes = []
    machine = results["machine"]
    notes.append(
        f"The machine's 1-minute load average was {machine['load_average_1m']} at the start and "
        f"{machine.get('load_average_1m_at_end')} at the end, on {machine['cores']} cores shared with other developers: "
        "single runs vary by up to several times (see the runs lists in results.json); compare the ratios."
    )
    for key, figure in results.items():
        backlog = isinstance(figure, dict) and figure.get("with_listen_backlog")
        if backlog:
            notes.append(
                f"`{key}`: {figure['value']} s against {results.get('rendezvous_64_workers_s', {}).get('value')} s for 64. "
                f"The server's listen backlog (request_queue_size {backlog['server_default']}) is smaller than the number of "
                "simultaneous connects, so the kernel drops the overflow's SYNs and TCP retries them after about a second. "
                f"With a backlog of {backlog['backlog']} (the server's connection limit) the same rendezvous took "
                f"{backlog['seconds']['median']} s (median); worker/rendezvous/server.py could set request_queue_size to MAX_CONNECTIONS."
            )
    if PROFILES_KEY in results:
        notes.append(
            f"`{PROFILES_KEY}`: a rank's peak RSS holds the Python, torch, DeepSpeed and transformers runtime and the "
            "activations as well as the model states, and only the model states are sharded, so measured memory ratios sit "
            "closer to 1 than the estimate's. Without a GPU the device and the host are the same RAM: offloading moves "
            "states from one to the other and saves nothing here, and ZeRO-3 also gathers the full weights once to write "
            "model/. The estimate's GPU column is the figure that matters on GPUs; its GPU+CPU column is the comparable one "
            "here. Throughput with gloo on one machine mostly reflects extra copies and Python hooks per step (ZeRO-3 "
            "gathers parameters layer by layer); single runs of a few steps on a shared machine are noisy, see "
            "samples_per_s_runs in results.json."
        )
        base_runs = results[PROFILES_KEY]["profiles"].get("zero0", {}).get("samples_per_s_runs", [])
        if len(base_runs) > 1 and max(base_runs) > 2 * min(base_runs):
            notes.append(
                f"zero0's own runs spread from {min(base_runs)} to {max(base_runs)} samples/s, so every samples/s ratio to "
                "zero0 carries that spread; compare the profiles' samples/s with each other rather than the ratios alone."
            )
    if "checkpoint_store" in results:
        notes.append(_store_note(results["checkpoint_store"]))
    prepare = results.get("prepare_examples_per_s")
    if prepare and prepare["sample"]["speedup"] < 1:
        parts = {name: prepare[name] for name in ("sample", "dev_questions") if name in prepare}
        call_gain = ", ".join(
            f"{name} {part['batched_tokenizer_call_only']['median'] / part['per_example_loop']['median']:.2f}x"
            for name, part in parts.items()
        )
        notes.append(
            "`prepare_examples_per_s`: batched `datasets.map` over a per-example loop: "
            + ", ".join(f"{name} {part['speedup']}x" for name, part in parts.items())
            + f". The tokenizer's batch call alone gains {call_gain} over the loop on these short texts (about 20-50 "
            "tokens); map's conversion to and from Arrow costs most of that back, more than all of it on the 1,200-question "
            "sample. prepare still wants map: it yields the Arrow dataset that save_to_disk stores and spreads work with "
            "num_proc where cores are free; the whole sample tokenizes in well under a second either way."
        )
    return notes


def write(results: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``results.json`` and ``README.md`` into ``out_dir`` (each through a temporary file and a rename).

    :rtype: tuple[pathlib.Path, pathlib.Path]
    """
    return write_json(out_dir / "results.json", results), atomic_write(out_dir / "README.md", markdown(results))


def markdown(results: dict) -> str:
    """The README: machine, releases, one row per figure with how it was measured, the profiles table, notes.

    :rtype: str
    """
    lines = [*_front(results), *_figures_table(results)]
    profiles = results.get(PROFILES_KEY)
    if profiles:
        lines += _profiles_table(profiles)
    step_ops = results.get(STEP_OPS_KEY)
    if step_ops:
        lines += _step_ops_table(step_ops)
    notes = [
        f"- `{key}` missed its goal ({results[key]['goal']}): {why}"
        for key, why in MISSED.items()
        if key in results and not _met(results[key])
    ]
    notes += [f"- {note}" for note in observations(results)]
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def _front(results: dict) -> list[str]:
    """The README's title, how it is made, when, and the machine and releases it was measured on."""
    machine, releases = results["machine"], results["releases"]
    return [
        "# Benchmarks",
        "",
        (
            "`make bench` (`.venv/bin/python -m bench`) writes this file and `results.json` from one run. Each comparison runs "
            "both arms in the same process, alternated, and reports the ratio of medians: the machine is shared, so absolute "
            "numbers are noisy and the ratios are what count. `python -m bench --only FIGURE[,FIGURE]` re-measures some "
            "figures and keeps the others."
        ),
        "",
        (
            f"Last invocation: {results['started']} to {results['finished']} UTC; each figure says when it was measured "
            "(machine load average below: at that invocation's start and end)."
        ),
        "",
        "| machine | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in machine.items()],
        "",
        "| release | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in releases.items()],
        "",
    ]


def _figures_table(results: dict) -> list[str]:
    """One row per figure measured, in :data:`FIGURES`' order."""
    lines = ["| figure | key | value | goal | how it was measured |", "|---|---|---|---|---|"]
    for key, label in FIGURES.items():
        figure = results.get(key)
        # A long figure is saved part by part; its row appears once its value and method are in.
        if figure and "value" in figure and "method" in figure:
            goal = figure.get("goal") or ""
            when = f" (measured {figure['measured_at']} UTC)" if "measured_at" in figure else ""
            lines.append(f"| {label} | `{key}` | {_value(key, figure)} | {goal} | {figure['method']}{when} |")
    return lines


def _profiles_table(profiles: dict) -> list[str]:
    """The DeepSpeed profiles section: samples/s, peak RSS and the estimate of each, against zero0."""
    lines = [
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
    return lines


def _step_ops_table(step_ops: dict) -> list[str]:
    """The ops and host syncs per step section, one row per arm."""
    lines = [
        "",
        f"## Ops and host syncs per step (`{STEP_OPS_KEY}`)",
        "",
        step_ops["method"] + ".",
        "",
        (
            "| arm | ops per training step | compute ops per training step | host syncs per training step "
            "| reduce calls | optimizer-phase ops | optimizer-phase host syncs |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ("default", "old_recipe"):
        row = step_ops[arm]
        lines.append(
            f"| {arm} | {row['ops']} | {row.get('compute_ops', '-')} | {row['host_syncs']} | {row['reduce_calls']} | "
            f"{row['optimizer_ops']} | {row['optimizer_host_syncs']} |"
        )
    return lines


def _store_note(store: dict) -> str:
    """What the checkpoint store's figure says on this machine, and what it does not."""
    return (
        f"`checkpoint_store`: steps took {store['value']}x as long with the store (seconds a step, runs without "
        f"{store['step_seconds']['without_store']['runs']}, with {store['step_seconds']['with_store']['runs']}: "
        "on this loaded machine one arm's runs spread further apart than the arms' medians). The S3 server "
        "(SeaweedFS), the upload in the launching process and both ranks share the same 2 cores here; on a "
        "cluster the upload runs in the launching process, off the workers. Resuming from the "
        f"store added a {store['download_s']} s download of one checkpoint; the two resumes' totals are single "
        "launches on a loaded machine, and their difference is mostly the launches' own spread."
    )


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
    text = f"**{figure['value']}** {figure['unit']}"
    for rates_key in ("samples_per_s", "examples_per_s"):
        if rates_key in figure:
            text += "<br>" + ", ".join(f"{arm} {rates['median']}/s" for arm, rates in figure[rates_key].items())
    if "parse_rate" in figure:
        text += "<br>parsed: " + ", ".join(f"{arm} {rate:.0%}" for arm, rate in figure["parse_rate"].items())
    if "detection_s" in figure:
        text += (
            f"<br>detection (kill to supervisor aware) {figure['detection_s']['median']} s, "
            f"repeated steps {figure['repeated_steps']}"
        )
    if "upload_seconds_per_checkpoint" in figure:
        resume = figure["resume_to_first_step_s"]
        text += (
            f"<br>upload {figure['upload_seconds_per_checkpoint']['median']} s per checkpoint "
            f"({figure['upload_megabytes_per_checkpoint']} MB); resume to the next step: from the store "
            f"{resume['from_store']} s, from local disk {resume['from_local_disk']} s"
        )
    if "value_cpu_time" in figure:
        text += f"<br>per CPU second: {figure['value_cpu_time']}x"
    if "seconds" in figure and len(figure["seconds"]["runs"]) > 1:
        text += f"<br>runs {figure['seconds']['runs']}"
    return text


def _met(figure: dict) -> bool:
    goal = figure.get("goal")
    if not goal:
        return True
    operator, bound = goal.split()
    return figure["value"] >= float(bound) if operator == ">=" else figure["value"] <= float(bound)
