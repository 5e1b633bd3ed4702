"""How much GPU memory each DeepSpeed profile needs per rank, from a model's config alone.

The model is built on PyTorch's meta device (shapes only, no weights, no download of weights); each
profile's model-state memory (16-bit parameters and gradients, fp32 master weights and Adam moments)
comes from its own memory model, :meth:`textsql.planning.profiles.Profile.memory`, so a profile added as a
JSON file in ``dsconfig/`` is estimated too. Activations come on top and depend on batch and sequence
length, hence the headroom in :data:`FIT_FRACTION`.

The same recommendation is the default profile of a run (:data:`AUTO_PROFILE`): notebook 02 resolves it
from its estimate before any worker starts (:func:`choose_profile`), and a rank given ``--profile auto``
resolves it from its own device and world (:func:`resolve_profile_here`), so what the estimate
recommends is what the run uses unless a profile is named.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, PretrainedConfig

from textsql.errors import ModelError, ProfileError
from textsql.model import load_config
from textsql.planning.profiles import AUTO_PROFILE, get_profile
from textsql.planning.profiles import profiles as all_profiles
from textsql.planning.world import ranks_on_this_node, world_size

logger = logging.getLogger(__name__)

GIB = 1024**3
# Share of a GPU's memory the model states may take; the rest is for activations, buffers and the
# CUDA context.
FIT_FRACTION = 0.8
# On DeepSpeed's CPU accelerator stage 0 ran at a third of stage 1's samples/s on 2 gloo ranks
# (bench/results.json, deepspeed_profiles: 0.97 against 2.91), so on CPUs stage 1 is tried first.
CPU_PREFERRED = "zero1"


def count_parameters(config: PretrainedConfig) -> tuple[int, int]:
    """Parameters of the model the config describes, and of its largest single module (ZeRO-3's peak).

    A T5 is counted from its dimensions (:func:`t5_parameters`); any other model is built on the meta device: no
    memory for weights and nothing downloaded.

    :returns: ``(total, largest_layer)``; tied weights count once.
    :rtype: tuple[int, int]
    """
    if config.model_type == "t5":
        return t5_parameters(config)
    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(config)
    total = sum(parameter.numel() for parameter in model.parameters())
    largest = max(
        sum(parameter.numel() for parameter in module.parameters(recurse=False)) for module in model.modules()
    )
    return total, largest


def t5_parameters(config: PretrainedConfig) -> tuple[int, int]:
    """:func:`count_parameters` of a T5 from its config's dimensions, as transformers' ``T5ForConditionalGeneration``
    builds it: importing the T5 modelling code to build one on the meta device takes 2 s of a launch's start.

    Each attention has bias-free query, key, value and output projections of ``num_heads x d_kv``; each layer norm is
    a weight of ``d_model``; the feed-forward has two input matrices when gated (T5 v1.1); the first layer of each
    stack holds the relative position bias. Untied (T5 v1.1), transformers ties none of the encoder's, the decoder's and
    the head's matrices to the shared embedding (``_tied_weights_keys`` apply only when tied): four of them.

    :returns: ``(total, largest_layer)``.
    :rtype: tuple[int, int]
    """
    d_model, inner, d_ff = config.d_model, config.num_heads * config.d_kv, config.d_ff
    embedding = config.vocab_size * d_model
    attention = 4 * d_model * inner
    feed_forward = (3 if config.is_gated_act else 2) * d_model * d_ff
    position_bias = config.relative_attention_num_buckets * config.num_heads
    encoder = config.num_layers * (attention + feed_forward + 2 * d_model) + position_bias + d_model
    decoder_layers = config.num_decoder_layers or config.num_layers
    decoder = decoder_layers * (2 * attention + feed_forward + 3 * d_model) + position_bias + d_model
    embeddings = embedding if config.tie_word_embeddings else 4 * embedding
    return embeddings + encoder + decoder, max(embedding, d_model * d_ff, d_model * inner)


def estimate(
    model: str | Path | None,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_gb: float,
    names: Iterable[str] | None = None,
    cpu: bool = False,
) -> dict:
    """Estimate every profile's memory for ``model`` on ``nodes`` x ``gpus_per_node`` GPUs and pick one.

    Usage::

        >>> report = estimate(None, nodes=2, gpus_per_node=1, gpu_memory_gb=16)
        >>> report["recommended"]
        'zero0'

    :param model: hub id, model directory, ``config.json`` path, or ``None`` for the embedded T5.
    :param gpu_memory_gb: memory of one GPU in GiB.
    :param names: only these profiles, by name or DeepSpeed JSON path (default: every one in ``dsconfig/``).
    :param cpu: the ranks run on DeepSpeed's CPU accelerator (``gpu_memory_gb`` is then host memory per rank).
    :returns: ``{"parameters", "largest_layer_parameters", "profiles": {name: {"zero_stage", "offload",
        "gpu_gb_per_rank", "cpu_gb_per_node", "fits", "estimator"}}, "recommended"}``; ``recommended``
        is the first profile (cheapest in communication) whose model states fit, ``None`` when none does;
        with ``cpu``, :data:`CPU_PREFERRED` first when it fits.
    :raises ProfileError: a name in ``names`` that is no profile.
    :rtype: dict
    """
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--gpu-memory-gb", gpu_memory_gb)):
        if value <= 0:
            raise ModelError(f"{flag} must be positive, got {value!r}")
    chosen = all_profiles(names)
    total, largest = count_parameters(load_config(model))
    budget = gpu_memory_gb * FIT_FRACTION
    rows = {}
    for profile in chosen:
        needs = profile.memory(total, largest, nodes, gpus_per_node)
        rows[profile.name] = {
            "zero_stage": profile.stage,
            "offload": "+".join(
                part
                for part, on in (("optimizer", profile.offload_optimizer), ("params", profile.offload_params))
                if on
            ),
            "gpu_gb_per_rank": round(needs.gpu / GIB, 3),
            "cpu_gb_per_node": round(needs.cpu / GIB, 3),
            "fits": needs.gpu / GIB <= budget,
            "estimator": needs.estimator,
        }
    fitting = [name for name, row in rows.items() if row["fits"]]
    recommended = CPU_PREFERRED if cpu and CPU_PREFERRED in fitting else next(iter(fitting), None)
    return {
        "model": str(model or "default"),
        "parameters": total,
        "largest_layer_parameters": largest,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "gpu_memory_gb": gpu_memory_gb,
        "cpu": cpu,
        "fit_fraction": FIT_FRACTION,
        "profiles": rows,
        "recommended": recommended,
    }


def format_estimate(report: dict, requested: str | None = None) -> str:
    """A table of the estimate for people; with ``requested``, a last line saying which profile the run uses.

    :param report: what :func:`estimate` returned.
    :param requested: the run's profile parameter (a name, a path, or :data:`AUTO_PROFILE`).
    :rtype: str
    """
    rank_memory = "GiB/rank" if report.get("cpu") else "GPU GiB/rank"
    lines = [
        (
            f"{report['model']}: {report['parameters'] / 1e6:,.1f}M parameters (largest layer {report['largest_layer_parameters'] / 1e6:,.1f}M), "
            + (
                f"{report['nodes']} node(s) x {report['gpus_per_node']} CPU rank(s), {report['gpu_memory_gb']:g} GiB of memory each"
                if report.get("cpu")
                else f"{report['nodes']} node(s) x {report['gpus_per_node']} GPU(s) of {report['gpu_memory_gb']:g} GiB"
            )
        ),
        f"{'profile':<14} {'ZeRO':>4}  {'offload':<16} {rank_memory:>12} {'CPU GiB/node':>12}  fits",
    ]
    for name, row in report["profiles"].items():
        lines.append(
            f"{name:<14} {row['zero_stage']:>4}  {row['offload'] or '-':<16} {row['gpu_gb_per_rank']:>12.2f} "
            f"{row['cpu_gb_per_node']:>12.2f}  {'yes' if row['fits'] else 'no'}"
        )
    memory = "each rank's memory" if report.get("cpu") else "GPU memory"
    budget = f"{report['fit_fraction']:.0%} of {memory} for model states, the rest for activations"
    if report["recommended"] is None:
        lines.append(f"recommended: none fits ({budget}); add GPUs or nodes, or use GPUs with more memory")
    else:
        why = "; on CPUs ZeRO-1 ran fastest" if report.get("cpu") and report["recommended"] == CPU_PREFERRED else ""
        lines.append(f"recommended: {report['recommended']} ({budget}{why})")
    if requested == AUTO_PROFILE and report["recommended"] is not None:
        lines.append(f"this run uses: {report['recommended']} (profile auto: the recommendation)")
    elif requested is not None and requested != AUTO_PROFILE:
        lines.append(f"this run uses: {requested} (named by the profile parameter)")
    return "\n".join(lines)


def choose_profile(profile: str, report: dict) -> str:
    """The profile a run uses: ``profile`` itself when one is named, the report's recommendation for ``auto``.

    Usage::

        >>> choose_profile("auto", estimate(None, nodes=2, gpus_per_node=1, gpu_memory_gb=16))
        'zero0'

    :param profile: a profile name or path, or :data:`AUTO_PROFILE`.
    :param report: what :func:`estimate` returned for the run's model and hardware.
    :raises ProfileError: an unknown profile, or ``auto`` when none fits; the message names the fix.
    :rtype: str
    """
    if profile != AUTO_PROFILE:
        get_profile(profile)
        return profile
    if report["recommended"] is None:
        raise ProfileError(
            f"profile auto: no profile fits {report['model']} on {report['nodes']} node(s) x {report['gpus_per_node']} device(s) "
            f"of {report['gpu_memory_gb']:g} GiB; add nodes or GPUs, or pass --profile (notebook: profile) zero3_offload"
        )
    return report["recommended"]


def workers_estimate(
    model: str | Path | None, workers: int, worker_gpus: int, gpu_memory_gb: float, worker_memory: float
) -> dict:
    """:func:`estimate` for notebook 02's workers (its parameters of the same names): ``workers`` nodes of
    ``worker_gpus`` GPUs, or on CPUs (``worker_gpus`` 0) one rank each with the pod's memory. The notebook shows it
    and the pipeline records the profile it picks (:func:`textsql.pipeline.parameters.resolved_training`).

    :rtype: dict
    """
    return estimate(
        model,
        nodes=workers,
        gpus_per_node=max(worker_gpus, 1),
        gpu_memory_gb=gpu_memory_gb if worker_gpus else worker_memory,
        cpu=not worker_gpus,
    )


def resolve_profile(
    profile: str, model: str | Path | None, nodes: int, gpus_per_node: int, gpu_memory_gb: float, cpu: bool = False
) -> str:
    """:func:`choose_profile` for this hardware; the model's config is read only for ``auto``.

    :rtype: str
    """
    if profile != AUTO_PROFILE:
        return profile
    return choose_profile(
        profile, estimate(model, nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb, cpu=cpu)
    )


def resolve_profile_here(profile: str, model: str | Path | None) -> str:
    """:func:`resolve_profile` from this rank's world (:mod:`textsql.planning.world`) and device.

    A GPU's memory where there is one; on DeepSpeed's CPU accelerator the host memory shared by the
    node's ranks. Every rank of a run on like nodes resolves the same profile.

    :rtype: str
    """
    if profile != AUTO_PROFILE:
        return profile
    ranks_per_node = ranks_on_this_node()
    nodes = max(1, world_size() // ranks_per_node)
    cpu = not torch.cuda.is_available()
    if cpu:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / ranks_per_node
    else:
        memory = torch.cuda.get_device_properties(0).total_memory / GIB
    return resolve_profile(profile, model, nodes, ranks_per_node, round(memory, 1), cpu=cpu)
