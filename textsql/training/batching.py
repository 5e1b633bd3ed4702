"""Batches filled to a token budget from length buckets, as translation toolkits batch (fairseq's
``--max-tokens``), instead of a fixed count of questions.

Each example falls into a (source, target) bucket whose bounds are length quantiles rounded up to a
multiple of 8, the top one at the 98th percentile; the longest 2 % (WikiSQL's lengths have a long tail)
fall into an overflow bucket of their own, padded to the longest, so they do not widen the top bucket for
everyone. A batch holds examples of one bucket only, padded to that bucket's bounds, and as many of them
as the budget allows (fewer for the overflow bucket's long examples). So a batch never exceeds the budget, padding
is small, and the model sees a few distinct shapes (one per bucket, plus each bucket's last, shorter batch); no
batch holds a single example where the budget allows two (dynamo compiles a dimension of size 1 apart): a bucket's
last example shares the bucket's last batch, a bucket of one example joins the smallest bucket that holds it.

Under ``--torch-compile true`` (``compiled=True``) each bucket has one shape: bounds in multiples of 16, every batch
full, the last topped up with the bucket's first examples of the epoch (as torch's ``DistributedSampler`` repeats a
few), since on one H200 the compiler specialized on a length's remainder by 16 and on a batch's size (4
recompilations, ``bench/gpu_quick.json``); the trainer marks the dimensions dynamic
(:func:`textsql.training.compiling.mark_batch_dynamic`). The order is shuffled per epoch from a seed, the same
global order on every rank, so all ranks step the same number of times.

Usage::

    >>> sampler = TokenBudgetBatchSampler([12, 30, 31, 9], [7, 20, 22, 5], max_tokens=128)
    >>> sorted(index for batch in sampler for index in batch)
    [0, 1, 2, 3]
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler

from textsql.constants import LABEL_PAD_TOKEN_ID, SOURCE_KEYS, TARGET_KEYS
from textsql.errors import DataError
from textsql.training.clipping import ClipBeforeStep, clip_before_each_step
from textsql.training.compiling import mark_batch_dynamic
from textsql.training.hardware import engine_autocast
from textsql.training.throughput import BatchCounts

logger = logging.getLogger(__name__)

ALIGN = 8  # tensor cores want dimensions in multiples of 8
COMPILED_ALIGN = 16  # attention's memory-efficient backward guards on a length's remainder by 16
DEFAULT_BUCKETS = 4  # per side, plus the overflow bucket: at most 5 x 5 (source, target) buckets, a few dozen shapes
# The quantile of the top bucket's bound; longer examples go to the overflow bucket. On the shipped sample's
# schema input the targets reach 87 tokens but 98 % stay within 34: a top bound at the longest padded
# a third of every batch (tests/test_batching.py measures both).
TOP_QUANTILE = 0.98


def round_up(length: int, multiple: int = ALIGN) -> int:
    """``length`` rounded up to a multiple of ``multiple``.

    :rtype: int
    """
    return -(-length // multiple) * multiple


def bucket_bounds(
    lengths: Sequence[int], buckets: int = DEFAULT_BUCKETS, align: int = ALIGN, top: float = TOP_QUANTILE
) -> tuple[int, ...]:
    """Upper length bounds of at most ``buckets`` buckets holding about as many examples each, and of an
    overflow bucket for the examples beyond the ``top`` quantile.

    Bounds sit at the quantiles ``top * i / buckets``, rounded up to multiples of ``align`` (equal ones
    merge); the last covers the longest.

    :rtype: tuple[int, ...]
    """
    if not lengths:
        raise DataError("no examples to batch; the train split is empty")
    ordered = sorted(lengths)
    levels = [top * i / buckets for i in range(1, buckets + 1)] + [1.0]
    quantiles = (ordered[max(math.ceil(level * len(ordered)) - 1, 0)] for level in levels)
    return tuple(sorted({round_up(max(length, 1), align) for length in quantiles}))


def padded_length(length: int, bounds: Sequence[int]) -> int:
    """The smallest bound that holds ``length``.

    :rtype: int
    """
    position = bisect.bisect_left(bounds, length)
    if position == len(bounds):
        raise DataError(f"length {length} exceeds the longest bucket ({bounds[-1]})")
    return bounds[position]


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices, each within ``max_tokens`` padded source plus target tokens.

    Every rank builds the same global list of batches for an epoch (seeded by ``seed`` and the epoch), repeats its
    first batches until the count divides by ``num_replicas`` (as torch's ``DistributedSampler`` repeats examples),
    and takes every ``num_replicas``-th batch from ``rank``. With one replica and not ``compiled`` every example
    comes exactly once an epoch.

    :param source_lengths: tokens of each example's input.
    :param target_lengths: tokens of each example's labels.
    :param max_tokens: budget of a batch: examples x (source bound + target bound) of their bucket.
    :param buckets: quantile buckets per side (the overflow bucket comes on top).
    :param seed: the shuffle's seed; the same on every rank.
    :param compiled: one shape a bucket, for torch.compile (the module's text).
    """

    # Not a fixed-size sampler: accelerate's shard wrapper must treat the batches as of varying size.
    batch_size = None
    drop_last = False

    def __init__(
        self,
        source_lengths: Sequence[int],
        target_lengths: Sequence[int],
        max_tokens: int,
        *,
        buckets: int = DEFAULT_BUCKETS,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        compiled: bool = False,
    ) -> None:
        if len(source_lengths) != len(target_lengths):
            raise DataError(f"{len(source_lengths)} source lengths but {len(target_lengths)} target lengths")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank!r} outside a world of {num_replicas!r}")
        align = COMPILED_ALIGN if compiled else ALIGN
        self.source_bounds = bucket_bounds(source_lengths, buckets, align)
        self.target_bounds = bucket_bounds(target_lengths, buckets, align)
        self.max_tokens, self.seed, self.num_replicas, self.rank = max_tokens, seed, num_replicas, rank
        self.compiled, self.epoch = compiled, 0
        groups: dict[tuple[int, int], list[int]] = {}
        for index, (source, target) in enumerate(zip(source_lengths, target_lengths)):
            key = (padded_length(source, self.source_bounds), padded_length(target, self.target_bounds))
            groups.setdefault(key, []).append(index)
        self.groups = _without_single_examples(dict(sorted(groups.items())))
        # A bucket under a full batch is one batch: topped up, its few examples would count many times in a step.
        self.batch_sizes = {key: max_tokens // sum(key) for key in self.groups}
        if compiled:
            self.batch_sizes = {key: min(size, len(self.groups[key])) for key, size in self.batch_sizes.items()}
        too_long = [key for key, size in self.batch_sizes.items() if size == 0]
        if too_long:
            raise DataError(
                f"examples padded to {too_long[-1][0]} + {too_long[-1][1]} tokens exceed the budget of {max_tokens}; "
                f"pass --max-tokens-per-batch {sum(too_long[-1])} or more"
            )
        self.global_batches = sum(math.ceil(len(group) / self.batch_sizes[key]) for key, group in self.groups.items())
        logger.info(
            "token batches: budget %d, source bounds %s, target bounds %s, %d batches an epoch over %d rank(s)",
            max_tokens,
            self.source_bounds,
            self.target_bounds,
            self.global_batches,
            num_replicas,
        )

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for ``epoch`` next (the trainer calls it at the start of each epoch)."""
        self.epoch = epoch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of one epoch, in order, padded to a multiple of the replica count.

        :rtype: list[list[int]]
        """
        generator = np.random.default_rng([self.seed, epoch])
        batches = []
        for key, group in self.groups.items():
            shuffled = [group[i] for i in generator.permutation(len(group))]
            if self.compiled:
                size = self.batch_sizes[key]
                shuffled += shuffled[: -len(shuffled) % size]
                batches += [shuffled[start : start + size] for start in range(0, len(shuffled), size)]
                continue
            starts = itertools.accumulate(batch_lengths(len(shuffled), self.batch_sizes[key]), initial=0)
            batches += [shuffled[start:end] for start, end in itertools.pairwise(starts)]
        batches = [batches[i] for i in generator.permutation(len(batches))]
        missing = -len(batches) % self.num_replicas
        return batches + list(itertools.islice(itertools.cycle(batches), missing))

    def shapes(self) -> set[tuple[int, int, int]]:
        """Every (examples, source tokens, target tokens) a batch can have.

        :rtype: set[tuple[int, int, int]]
        """
        if self.compiled:
            return {(size, source, target) for (source, target), size in self.batch_sizes.items()}
        return {
            (examples, source, target)
            for (source, target), group in self.groups.items()
            for examples in batch_lengths(len(group), self.batch_sizes[(source, target)])
        }

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.epoch_batches(self.epoch)[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return math.ceil(self.global_batches / self.num_replicas)


def batch_lengths(count: int, size: int) -> list[int]:
    """How many examples each batch of a bucket of ``count`` examples holds, at most ``size`` each: full batches,
    and a last one of the rest; a rest of one example shares the last two batches with the one before, where that
    leaves two examples in each.

    :rtype: list[int]
    """
    lengths = [size] * (count // size) + ([count % size] if count % size else [])
    if lengths[-1] == 1 and len(lengths) > 1 and size >= 3:
        lengths[-2:] = [(size + 1) - (size + 1) // 2, (size + 1) // 2]
    return lengths


def _without_single_examples(groups: dict[tuple[int, int], list[int]]) -> dict[tuple[int, int], list[int]]:
    """``groups`` with each group of one example moved into the smallest other group whose bounds hold it (padded
    further, never batched alone), where there is one."""
    for key in list(groups):
        if len(groups[key]) != 1:
            continue
        wider = [other for other in groups if other != key and other[0] >= key[0] and other[1] >= key[1]]
        if wider:
            groups[min(wider, key=lambda other: (sum(other), other))] += groups.pop(key)
    return groups


class BucketPadding:
    """Wrap a collator so each batch is padded to its bucket's bounds, not to its longest member.

    :param collator: pads to the longest member (``DataCollatorForSeq2Seq``).
    :param source_bounds: bucket bounds of the inputs; ``target_bounds`` those of the labels.
    """

    def __init__(
        self,
        collator: Callable[[list[dict]], dict],
        source_bounds: Sequence[int],
        target_bounds: Sequence[int],
        pad_token_id: int,
    ) -> None:
        self.collator, self.source_bounds, self.target_bounds = collator, tuple(source_bounds), tuple(target_bounds)
        self.fill = {
            "input_ids": pad_token_id,
            "attention_mask": 0,
            "labels": LABEL_PAD_TOKEN_ID,
            "decoder_input_ids": pad_token_id,
            "decoder_attention_mask": 0,
        }

    def __call__(self, features: list[dict]) -> dict:
        batch = self.collator(features)
        for keys, bounds in ((SOURCE_KEYS, self.source_bounds), (TARGET_KEYS, self.target_bounds)):
            for key in keys:
                if key in batch:
                    tensor = batch[key]
                    width = padded_length(tensor.shape[1], bounds)
                    batch[key] = torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=self.fill[key])
        return batch


class TokenBudgetTrainer(Seq2SeqTrainer):
    """``Seq2SeqTrainer`` whose training batches are filled to ``max_tokens_per_batch`` from length buckets.

    With ``max_tokens_per_batch`` unset it is the plain trainer (``per_device_train_batch_size`` examples a batch).
    With ``optimizer_max_grad_norm`` the optimizer clips the gradients to that norm itself, right before each
    step (:mod:`textsql.training.clipping`: a fixed handful of ops for all tensors, no host read): for DeepSpeed configs
    that leave clipping out (:func:`textsql.planning.profiles.autocast_bf16`), where the engine steps the
    optimizer inside the backward call and the trainer's own clipping would come too late.
    """

    # Narrower than the trainer declares them: this project always hands it these (the model unwrapped; the
    # DeepSpeed engine is ``model_wrapped``).
    args: Seq2SeqTrainingArguments
    model: PreTrainedModel
    processing_class: PreTrainedTokenizerBase

    def __init__(
        self,
        *args: Any,
        max_tokens_per_batch: int | None = None,
        buckets: int = DEFAULT_BUCKETS,
        optimizer_max_grad_norm: float = 0.0,
        length_group_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_tokens_per_batch, self.buckets = max_tokens_per_batch, buckets
        self.optimizer_max_grad_norm = optimizer_max_grad_norm
        self.length_group_size = length_group_size
        self.clipping: ClipBeforeStep | None = None
        self.batch_counts = BatchCounts()

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """The trainer's optimizer, clipping before each step when ``optimizer_max_grad_norm`` is set.

        :rtype: torch.optim.Optimizer
        """
        created = self.optimizer is None
        optimizer = super().create_optimizer(*args, **kwargs)
        if created and self.optimizer_max_grad_norm > 0:
            self.clipping = clip_before_each_step(optimizer, self.optimizer_max_grad_norm)
        return optimizer

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """The trainer's step, counting what the batch held (:mod:`textsql.training.throughput`), without the
        decoder's generation cache: T5 builds one in any forward its config lets (``use_cache``), where a training
        step only fills and drops it (72 of a t5-small step's 3,918 operators, ``bench/compile_warmup.json``), and
        whose per-layer flags torch.compile guards on, compiling a decoder block again for each layer.

        :rtype: torch.Tensor
        """
        self.batch_counts.add(inputs)
        return super().training_step(model, {**inputs, "use_cache": False}, *args, **kwargs)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        # Marked on the device's tensors: a copy to the device would not carry the marks.
        prepared: dict[str, Any] = super()._prepare_inputs(inputs)
        if self.max_tokens_per_batch and self.args.torch_compile:
            mark_batch_dynamic(prepared)
        return prepared

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        """The trainer's evaluation step under the DeepSpeed engine's torch autocast, when training runs under one.

        The engine casts its own forward (the evaluation loss), but ``Seq2SeqTrainer`` generates through the
        unwrapped model, outside it: generation would run in fp32 while training ran in bf16.
        """
        with engine_autocast(self.model_wrapped):
            return super().prediction_step(*args, **kwargs)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        # DeepSpeed has no norm of a plain optimizer's gradients (get_global_grad_norm is None): the clipping hook's
        # tensor stands in, read on the host (.item()) by the parent only at a logging step.
        if grad_norm is None and self.clipping is not None:
            grad_norm = self.clipping.norm
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _get_train_sampler(self, train_dataset: Dataset | None = None) -> Sampler | None:
        # transformers groups lengths by per-rank batch x accumulation, which changes with the world size; a given
        # group size keeps the examples' order whatever the ranks. Lengths read a column at a time, not a row (every
        # column) at a time as the sampler would: 2 s less on each rank for the demo's 64,000 questions.
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy != "group_by_length" or dataset is None:
            return super()._get_train_sampler(train_dataset)
        name = self.processing_class.model_input_names[0] if self.processing_class else "input_ids"
        group_size = self.length_group_size or self.args.train_batch_size * self.args.gradient_accumulation_steps
        return LengthGroupedSampler(group_size, lengths=[len(ids) for ids in dataset[name]])

    def get_train_dataloader(self) -> DataLoader:
        """The token-budget loader, or the trainer's own without a budget.

        :rtype: torch.utils.data.DataLoader
        """
        if not self.max_tokens_per_batch:
            return super().get_train_dataloader()
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        sampler = TokenBudgetBatchSampler(
            [len(ids) for ids in dataset["input_ids"]],
            [len(ids) for ids in dataset["labels"]],
            self.max_tokens_per_batch,
            buckets=self.buckets,
            seed=self.args.seed,
            num_replicas=self.args.world_size,
            rank=self.args.process_index,
            compiled=self.args.torch_compile,
        )
        pad_id = self.processing_class.pad_token_id
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=BucketPadding(self.data_collator, sampler.source_bounds, sampler.target_bounds, pad_id),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
            prefetch_factor=self.args.dataloader_prefetch_factor,
        )
        prepared = self.accelerator.prepare(loader)
        # The sampler shards by rank itself; accelerate's wrapper would shard again and drop batches, so
        # it is made a pass-through, as the trainer does for its own rank-aware batch sampler.
        wrapper = getattr(prepared, "batch_sampler", None)
        if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes, wrapper.process_index = 1, 0
        return prepared
