"""How much GPU memory each DeepSpeed profile needs per rank, from a model's config alone.

The model is built on PyTorch's meta device (shapes only, no weights, no download of weights), and the
model-state memory (16-bit parameters and gradients, fp32 master weights and Adam moments) comes from
DeepSpeed's own estimators where it has them: ZeRO-2 (``estimate_zero2_model_states_mem_needs``)
and ZeRO-3 with and without offload (``estimate_zero3_model_states_mem_needs``). DeepSpeed has none
for stages 0 and 1; those use the same byte counts with less sharded (see :func:`profile_memory`).
Activations come on top and depend on batch and sequence length, hence the headroom in
:data:`FIT_FRACTION`.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, PretrainedConfig

from textsql.errors import ModelError
from textsql.model import resolve_model
from textsql.profiles import PROFILE_ORDER

logger = logging.getLogger(__name__)

GIB = 1024**3
# Share of a GPU's memory the model states may take; the rest is for activations, buffers and the
# CUDA context.
FIT_FRACTION = 0.8
# Bytes per parameter in mixed-precision Adam training, DeepSpeed's own accounting (its estimators'
# 2 + 18): 16-bit parameters, 16-bit gradients, fp32 gradients, fp32 master parameters, fp32 Adam moments.
PARAM16_BYTES = 2
GRAD_BYTES = 2 + 4
OPTIMIZER_BYTES = 4 + 8


def load_config(model: str | Path | None) -> PretrainedConfig:
    """Read a model's config: a model directory, a ``config.json`` file, or a hub id (needs the network).

    :rtype: transformers.PretrainedConfig
    """
    path = Path(str(model)).expanduser() if model not in (None, "", "default") else None
    try:
        if path is not None and path.is_file():
            return AutoConfig.from_pretrained(str(path.resolve()))
        return AutoConfig.from_pretrained(resolve_model(model))
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot read a model config from {str(model)!r} ({error}); pass --model a directory with config.json, a config.json file, or a hub id on a connected machine") from None


def count_parameters(config: PretrainedConfig) -> tuple[int, int]:
    """Parameters of the model the config describes, and of its largest single module (ZeRO-3's peak).

    Built on the meta device: no memory for weights and nothing downloaded.

    :returns: ``(total, largest_layer)``; tied weights count once.
    :rtype: tuple[int, int]
    """
    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(config)
    total = sum(parameter.numel() for parameter in model.parameters())
    largest = max(sum(parameter.numel() for parameter in module.parameters(recurse=False)) for module in model.modules())
    return total, largest


def profile_memory(total: int, largest: int, nodes: int, gpus_per_node: int) -> dict[str, dict]:
    """Per-rank GPU and per-node CPU memory (bytes) of the model states under each profile.

    :param total: parameter count.
    :param largest: parameters of the largest module.
    :rtype: dict[str, dict]
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    ranks = nodes * gpus_per_node
    # No DeepSpeed estimator below stage 2: every rank holds everything (zero0), or only the
    # optimizer side (fp32 gradients, master weights, moments) is split across ranks (zero1).
    zero0 = total * (PARAM16_BYTES + GRAD_BYTES + OPTIMIZER_BYTES)
    zero1 = total * (PARAM16_BYTES + 2) + total * (4 + OPTIMIZER_BYTES) // ranks
    cpu_unsharded = total * 4 * gpus_per_node * 1.5  # what DeepSpeed's estimators count for loading
    zero2_cpu, zero2 = estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=False)
    zero3_cpu, zero3, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=False)
    offload_cpu, offload, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=True, cpu_offload_params=True)
    return {
        "zero0": {"gpu": zero0, "cpu": cpu_unsharded, "estimator": "2+18 bytes/parameter, nothing sharded"},
        "zero1": {"gpu": zero1, "cpu": cpu_unsharded, "estimator": "2+18 bytes/parameter, optimizer states sharded"},
        "zero2": {"gpu": zero2, "cpu": zero2_cpu, "estimator": "deepspeed estimate_zero2_model_states_mem_needs"},
        "zero3": {"gpu": zero3, "cpu": zero3_cpu, "estimator": "deepspeed estimate_zero3_model_states_mem_needs"},
        "zero3_offload": {"gpu": offload, "cpu": offload_cpu, "estimator": "deepspeed estimate_zero3_model_states_mem_needs (cpu offload)"},
    }


def estimate(model: str | Path | None, nodes: int, gpus_per_node: int, gpu_memory_gb: float) -> dict:
    """Estimate every profile's memory for ``model`` on ``nodes`` x ``gpus_per_node`` GPUs and pick one.

    Usage::

        >>> report = estimate(None, nodes=2, gpus_per_node=1, gpu_memory_gb=16)
        >>> report["recommended"]
        'zero0'

    :param model: hub id, model directory, ``config.json`` path, or ``None`` for the embedded T5.
    :param gpu_memory_gb: memory of one GPU in GiB.
    :returns: ``{"parameters", "largest_layer_parameters", "profiles": {name: {"gpu_gb_per_rank",
        "cpu_gb_per_node", "fits", "estimator"}}, "recommended"}``; ``recommended`` is the first
        profile (cheapest in communication) whose model states fit, ``None`` when none does.
    :rtype: dict
    """
    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--gpu-memory-gb", gpu_memory_gb)):
        if value <= 0:
            raise ModelError(f"{name} must be positive, got {value!r}")
    total, largest = count_parameters(load_config(model))
    budget = gpu_memory_gb * FIT_FRACTION
    profiles = {
        name: {
            "gpu_gb_per_rank": round(needs["gpu"] / GIB, 3),
            "cpu_gb_per_node": round(needs["cpu"] / GIB, 3),
            "fits": needs["gpu"] / GIB <= budget,
            "estimator": needs["estimator"],
        }
        for name, needs in profile_memory(total, largest, nodes, gpus_per_node).items()
    }
    recommended = next((name for name in PROFILE_ORDER if profiles[name]["fits"]), None)
    return {
        "model": str(model or "default"),
        "parameters": total,
        "largest_layer_parameters": largest,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "gpu_memory_gb": gpu_memory_gb,
        "fit_fraction": FIT_FRACTION,
        "profiles": profiles,
        "recommended": recommended,
    }


def format_estimate(report: dict) -> str:
    """A table of the estimate for people.

    :rtype: str
    """
    lines = [
        f"{report['model']}: {report['parameters'] / 1e6:,.1f}M parameters (largest layer {report['largest_layer_parameters'] / 1e6:,.1f}M), "
        f"{report['nodes']} node(s) x {report['gpus_per_node']} GPU(s) of {report['gpu_memory_gb']:g} GiB",
        f"{'profile':<14} {'GPU GiB/rank':>12} {'CPU GiB/node':>12}  fits",
    ]
    for name, row in report["profiles"].items():
        lines.append(f"{name:<14} {row['gpu_gb_per_rank']:>12.2f} {row['cpu_gb_per_node']:>12.2f}  {'yes' if row['fits'] else 'no'}")
    budget = f"{report['fit_fraction']:.0%} of GPU memory for model states, the rest for activations"
    if report["recommended"] is None:
        lines.append(f"recommended: none fits ({budget}); add GPUs or nodes, or use GPUs with more memory")
    else:
        lines.append(f"recommended: {report['recommended']} ({budget})")
    return "\n".join(lines)
