"""What ``gpu-quick`` (:mod:`bench.gpu_quick`) derives from its arms and prints: the defaults' samples/s over each
peer's, the price of torch.compile, and the markdown table."""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

# The table's rows, in the order a reader compares them: the defaults, the peers, the larger model, then the
# defaults with torch.compile turned the other way (only one of the two runs).
ARMS = (
    "defaults",
    "peer",
    "old_recipe",
    "defaults_t5_base",
    "defaults_double_budget",
    "defaults_eager",
    "defaults_compiled",
    "defaults_compiled_warm",
    "defaults_compiled_graphs",
)
# What the defaults are compared with: the headline value is over the first.
PEERS = ("peer", "old_recipe")
# The arms that differ only in torch.compile.
COMPILE_ARMS = ("defaults", "defaults_eager", "defaults_compiled")
TOP_KERNELS_SHOWN = 3


def ratios(arms: dict) -> dict:
    """The defaults' samples/s over each peer's that has run (``defaults_over``), the first peer's as ``value``.

    :rtype: dict
    """
    if "defaults" not in arms:
        return {}
    ours = arms["defaults"]["samples_per_s"]
    over = {peer: round(ours / arms[peer]["samples_per_s"], 2) for peer in PEERS if peer in arms}
    if not over:
        return {}
    headline = next(iter(over))
    return {
        "value": over[headline],
        "unit": f"x (samples/s of the defaults / the {headline.replace('_', ' ')}'s, same device, same run)",
        "defaults_over": over,
    }


def compile_price(arms: dict, steps: int) -> dict:
    """What torch.compile cost against the same run eager, where both ran: the extra wall seconds, the median step's
    saving, and the steps after which a run compiled is done sooner than eager; with an empty compile cache
    (``compile``), where ``defaults_compiled_warm`` ran, with the cache the first compiled run left
    (``compile_warm``: what a second run pays), and where ``defaults_compiled_graphs`` ran, replayed as CUDA graphs
    (``compile_graphs``).

    :rtype: dict
    """
    by_compile = {arm["torch_compile"]: arm for name, arm in arms.items() if name in COMPILE_ARMS}
    if set(by_compile) != {False, True}:
        return {}
    eager = by_compile[False]
    priced = {
        "compile": by_compile[True],
        "compile_warm": arms.get("defaults_compiled_warm"),
        "compile_graphs": arms.get("defaults_compiled_graphs"),
    }
    return {key: price(eager, compiled, steps) for key, compiled in priced.items() if compiled is not None}


def price(eager: dict, compiled: dict, steps: int) -> dict:
    """One compiled arm against the eager one (:func:`compile_price`).

    :rtype: dict
    """
    extra_s = compiled["wall_s"] - eager["wall_s"]
    saved_s = eager["median_step_s"] - compiled["median_step_s"]
    return {
        "extra_wall_s": round(extra_s, 1),
        "median_step_s_saved": round(saved_s, 4),
        "samples_per_s_over_eager": round(compiled["samples_per_s"] / eager["samples_per_s"], 2),
        # wall(n) = start-up + compilation + n x step: equal for both at n = steps + extra_s / saved_s.
        # Rounded first: float noise must not add a step (183 / 0.02 is 9150.000000000002).
        "break_even_steps": math.ceil(round(steps + extra_s / saved_s, 6)) if saved_s > 0 else None,
    }


def busy(arm: dict) -> str:
    """The arm's busy fraction as a percentage, or ``n/a`` without a timeline.

    :rtype: str
    """
    timeline = arm.get("timeline")
    if not timeline or timeline["busy_fraction"] is None:
        return "n/a"
    return f"{timeline['busy_fraction']:.0%}"


def loss(arm: dict) -> str:
    """The arm's loss vocabulary, and for the full one whether its steps built T5's logits (``logits``) or computed
    the loss in slices (``sliced``, :func:`textsql.training.loss.full_vocabulary_loss`); a run from before the
    sliced loss names the vocabulary alone.

    :rtype: str
    """
    if arm["loss_vocabulary"] != "full" or "full_logits" not in arm:
        return arm["loss_vocabulary"]
    return f"full, {'logits' if arm['full_logits'] else 'sliced'}"


def table(result: dict) -> str:
    """The result as a markdown table, one row an arm, then the labels, the ratios and the timelines.

    :rtype: str
    """
    versions = result["versions"]
    lines = [
        f"gpu-quick on {result['device']} (torch {versions['torch']}, CUDA {versions['cuda']}), "
        + f"model {result['model']}",
        "",
        "| arm | samples/s | real tokens/s | MFU | busy | peak memory GiB | loss vocabulary | warm-up s "
        + "| median step s | slowest step s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    shown = [name for name in ARMS if name in result["arms"]]
    for name in shown:
        arm = result["arms"][name]
        share = "n/a" if arm["mfu_real_tokens"] is None else f"{arm['mfu_real_tokens']:.2%}"
        lines.append(
            f"| {name} | {arm['samples_per_s']} | {arm['real_tokens_per_s']} | {share} | {busy(arm)} | "
            f"{arm['peak_memory_gib']} | {loss(arm)} | "
            f"{arm['warmup_s']} | {arm['median_step_s']} | {arm['slowest_step_s']} |"
        )
    lines += ["", *(f"- {name}: {result['arms'][name]['label']}" for name in shown)]
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"- {name}: not run ({reason})")
    if "defaults_over" in result:
        over = "; ".join(
            f"defaults / {peer.replace('_', ' ')}: {ratio}x" for peer, ratio in result["defaults_over"].items()
        )
        lines += ["", f"samples/s {over}" + (f"; {result['wall_s']} s in all" if "wall_s" in result else "")]
    if "norms" in result:
        lines += norm_lines(result["norms"])
    if "sliced_loss" in result:
        lines += sliced_loss_lines(result["sliced_loss"])
    if "time_to_accuracy" in result:
        lines += accuracy_lines(result["time_to_accuracy"])
    lines += timelines(result["arms"], shown)
    for name in shown:
        arm = result["arms"][name]
        if "recompilations" in arm:
            lines.append(
                f"{name}: torch.compile compiled the model again {arm['recompilations']['count']} time(s), "
                f"{arm.get('compilations_after_warmup', 'n/a')} graph(s) compiled after the warm-up"
            )
    for key, cache in (("compile", "an empty compile cache"), ("compile_warm", "the cache the first run left")):
        cost = result.get(key)
        if cost:
            pays = (
                "never, at these step times"
                if cost["break_even_steps"] is None
                else f"after {cost['break_even_steps']} steps"
            )
            lines.append(
                f"torch.compile with {cache}: {cost['extra_wall_s']} s more than eager over the run, "
                f"{cost['median_step_s_saved']} s saved a step (median), {cost['samples_per_s_over_eager']}x eager's "
                f"samples/s; a run is done sooner compiled {pays}"
            )
    return "\n".join(lines)


def timelines(arms: dict, shown: list[str]) -> list[str]:
    """One line per profiled arm: what was read, how busy, and its top kernels by time.

    :rtype: list[str]
    """
    lines = []
    for name in shown:
        timeline = arms[name].get("timeline")
        if not timeline:
            continue
        top = ", ".join(
            f"{kernel['name'][:60]} {kernel['share_of_kernel_time'] or 0:.0%}"
            for kernel in timeline["top_kernels"][:TOP_KERNELS_SHOWN]
        )
        lines.append(
            f"{name} timeline ({timeline['activity']}, {timeline['steps']} step{'s' * (timeline['steps'] != 1)}): "
            f"{busy(arms[name])} busy, "
            f"{timeline['kernels_per_step']} a step; top: {top}"
        )
    return ([""] if lines else []) + lines


def norm_lines(figure: dict) -> list[str]:
    """T5's norms against torch's RMSNorm (bench.norms), a line a shape: each arm's step and kernels, and the ratio.

    :rtype: list[str]
    """
    lines = [""]
    for shape, measured in figure["shapes"].items():
        own, fused = measured["arms"]["t5_norms"], measured["arms"]["fused_norms"]
        lines.append(
            f"norms ({shape}, {measured['norms_swapped']} norms): a step with T5's own {own['median_step_ms']} ms "
            f"({own['timeline']['kernels_per_step']} kernels), with torch's RMSNorm {fused['median_step_ms']} ms "
            f"({fused['timeline']['kernels_per_step']}); T5's over torch's: {measured['t5_norms_over_fused_step']}x"
        )
    return lines


def accuracy_lines(figure: dict) -> list[str]:
    """The time-to-accuracy figure: each arm's time to the target or how far it got, then the ratio.

    :rtype: list[str]
    """
    lines = ["", f"time to {figure['target']} on {figure['held_out_questions']} held-out questions:"]
    for name, arm in figure["arms"].items():
        if arm["reached"]:
            lines.append(
                f"- {name}: {arm['training_s']} s of training ({arm['wall_s']} s with evaluations), step {arm['step']}"
            )
        else:
            lines.append(
                f"- {name}: not reached in {arm['training_s']} s of training ({arm['steps']} steps, "
                f"best {arm['best_lf_accuracy']})"
            )
    if figure.get("value") is not None:
        lines.append(f"the peer took {figure['value']}x the defaults' training time")
    if common := figure.get("common_score"):
        lines.append(
            f"to {common['lf_accuracy']}, the best both reached: defaults {common['defaults_training_s']} s, "
            f"peer {common['peer_training_s']} s of training ({common['value']}x)"
        )
    return lines


def sliced_loss_lines(figure: dict) -> list[str]:
    """The full-vocabulary loss with T5's logits and in slices (bench.sliced_loss), a line a shape: each arm's step
    and peak memory.

    :rtype: list[str]
    """
    lines = [""]
    for shape, measured in figure["shapes"].items():
        arms = "; ".join(
            f"{name.replace('_', ' ')} {arm['median_step_ms']} ms, {arm['peak_memory_mib']} MiB"
            for name, arm in measured["arms"].items()
        )
        missing = f" ({measured['not_measured']})" if "not_measured" in measured else ""
        lines.append(
            f"full-vocabulary loss ({shape}, {measured['target_positions']} target positions): {arms}{missing}"
        )
    return lines
