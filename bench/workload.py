"""What the GPU figures (``gpu``, ``gpu-quick``) train on and measure against: the model, the data, the FLOPs
of its samples and the device's peak."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import datasets
import torch
from transformers import AutoConfig

from bench.flops import T5Shape, peak_flops
from bench.fullscale import full_scale
from bench.ours import device_name
from bench.profiles import model_dir
from textsql.constants import DEFAULT_MODEL_DIR

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    """The model directory and full-scale data of a GPU figure, with what its FLOPs are counted from."""

    device: str  # cuda or cpu
    device_name: str  # CUDA's name of GPU 0, or "cpu"
    model: Path
    model_label: str
    data: Path
    shape: T5Shape
    lengths: tuple[list[int], list[int]]  # source and target tokens of every training example
    peak: float | None  # the device's peak FLOP/s (bench.flops.peak_flops)
    source_questions: int  # training questions of the prepared sample the data is resampled from

    @classmethod
    def build(cls, data_dir: str, work: Path, device: str, tiny_model: bool, questions: int) -> Workload:
        """The embedded small T5 or one of t5-small's shape (``textsql/assets/t5-small``, random weights), and
        ``questions`` training questions resampled from ``data_dir`` (:func:`bench.fullscale.full_scale`).

        :param data_dir: a ``textsql prepare`` output in schema form.
        :rtype: Workload
        """
        name = device_name(device)
        model = DEFAULT_MODEL_DIR if tiny_model else model_dir(work)
        data = full_scale(data_dir, work / f"fullscale-{questions}", questions)
        shape = T5Shape.from_config(AutoConfig.from_pretrained(model))
        train = datasets.load_from_disk(str(data))["train"]
        return cls(
            device=device,
            device_name=name,
            model=model,
            model_label="the embedded small T5"
            if tiny_model
            else f"of t5-small shape ({shape.d_model} wide, random weights, seed 42)",
            data=data,
            shape=shape,
            lengths=([len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]]),
            peak=peak_flops(name, os.cpu_count()),
            source_questions=len(datasets.load_from_disk(data_dir)["train"]),
        )

    def shaped_as(self, config: Path, work: Path) -> Workload:
        """The same data and device with a model of ``config``'s shape (random weights, seed 42), or, where this one
        is the embedded small T5 (a smoke run), that model again.

        :rtype: Workload
        """
        if self.model == DEFAULT_MODEL_DIR:
            return self
        model = model_dir(work, config)
        shape = T5Shape.from_config(AutoConfig.from_pretrained(model))
        label = f"of {config.parent.name} shape ({shape.d_model} wide, random weights, seed 42)"
        return dataclasses.replace(self, model=model, model_label=label, shape=shape)

    @property
    def questions(self) -> int:
        return len(self.lengths[0])

    def describe_data(self) -> str:
        """:rtype: str"""
        return (
            f"{self.questions} training questions resampled with replacement from the prepared sample's "
            f"{self.source_questions} (its joint source/target length distribution), schema input"
        )


def versions() -> dict:
    """torch, its CUDA and DeepSpeed, as the figures record them.

    :rtype: dict
    """
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed": metadata.version("deepspeed")}
