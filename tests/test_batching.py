"""Token-budget batching: budget, coverage, determinism, ranks and shapes, on lengths like WikiSQL's."""

import random
from collections import Counter

import pytest
import torch
from transformers import DataCollatorForSeq2Seq

from textsql.constants import DEFAULT_MODEL_DIR, LABEL_PAD_TOKEN_ID
from textsql.errors import DataError
from textsql.training.batching import (
    BucketPadding,
    TokenBudgetBatchSampler,
    batch_lengths,
    bucket_bounds,
    mark_batch_dynamic,
    padded_length,
    round_up,
)

BUDGET = 2048


@pytest.fixture(scope="module")
def lengths() -> tuple[list[int], list[int]]:
    """1,000 (source, target) lengths around WikiSQL's (inputs 20-140 tokens, queries 8-50)."""
    generator = random.Random(7)
    sources = [min(140, max(20, int(generator.gauss(65, 20)))) for _ in range(1000)]
    targets = [min(50, max(8, int(generator.gauss(22, 7)))) for _ in range(1000)]
    return sources, targets


def sampler(lengths, **kwargs) -> TokenBudgetBatchSampler:
    return TokenBudgetBatchSampler(*lengths, BUDGET, **kwargs)


def test_bounds_are_multiples_of_8_and_cover_the_longest(lengths):
    bounds = bucket_bounds(lengths[0], buckets=4)
    assert len(bounds) <= 5 and all(bound % 8 == 0 for bound in bounds)  # 4 quantile buckets and the overflow one
    assert bounds[-1] == round_up(max(lengths[0])) and list(bounds) == sorted(bounds)
    assert padded_length(bounds[0] + 1, bounds) == bounds[1]


def test_every_batch_fits_the_budget_in_padded_tokens(lengths):
    sources, targets = lengths
    batches = list(sampler(lengths))
    for batch in batches:
        source = padded_length(max(sources[i] for i in batch), sampler(lengths).source_bounds)
        target = padded_length(max(targets[i] for i in batch), sampler(lengths).target_bounds)
        assert len(batch) * (source + target) <= BUDGET
    # Filled, not trickling: most batches use most of the budget.
    assert len(batches) < 1000 * (65 + 22) / BUDGET * 2


def test_every_example_once_an_epoch(lengths):
    batches = sampler(lengths)
    for epoch in (0, 1):
        batches.set_epoch(epoch)
        assert sorted(index for batch in batches for index in batch) == list(range(1000))


def test_order_is_fixed_by_seed_and_epoch(lengths):
    first, again, other_seed = sampler(lengths, seed=1), sampler(lengths, seed=1), sampler(lengths, seed=2)
    assert list(first) == list(again)
    assert list(first) != list(other_seed)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0


def test_ranks_get_equal_batch_counts_and_cover_everything(lengths):
    for world in (2, 3, 4):
        ranks = [list(sampler(lengths, seed=3, num_replicas=world, rank=rank)) for rank in range(world)]
        assert len({len(batches) for batches in ranks}) == 1
        assert all(len(batches) == len(sampler(lengths, num_replicas=world, rank=0)) for batches in ranks)
        seen = Counter(index for batches in ranks for batch in batches for index in batch)
        assert set(seen) == set(range(1000))
        # Only the batches repeated to even out the ranks come twice: fewer than one per rank.
        assert sum(seen.values()) - 1000 < world * max(len(batch) for batch in ranks[0])


def test_a_tiny_dataset_still_feeds_every_rank():
    batches = [list(TokenBudgetBatchSampler([10], [5], 64, num_replicas=4, rank=rank)) for rank in range(4)]
    assert batches == [[[0]]] * 4


def test_distinct_shapes_are_bounded_and_predicted(lengths):
    padder = sampler(lengths)
    sources, targets = lengths
    seen = set()
    for epoch in range(3):
        padder.set_epoch(epoch)
        for batch in padder:
            seen.add(
                (
                    len(batch),
                    padded_length(max(sources[i] for i in batch), padder.source_bounds),
                    padded_length(max(targets[i] for i in batch), padder.target_bounds),
                )
            )
    assert seen <= padder.shapes()
    assert len(padder.shapes()) <= 2 * 5 * 5  # two per bucket: 4 quantile buckets and the overflow one a side


def test_an_example_over_the_budget_names_the_flag():
    with pytest.raises(DataError, match="--max-tokens-per-batch"):
        TokenBudgetBatchSampler([100, 20], [40, 8], 64)


def test_bucket_padding_pads_to_the_bucket_bounds(tmp_path):
    from textsql.model import load_tokenizer

    tokenizer = load_tokenizer()
    collator = BucketPadding(
        DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=LABEL_PAD_TOKEN_ID, pad_to_multiple_of=8),
        (16, 40),
        (8, 24),
        tokenizer.pad_token_id,
    )
    features = [
        {"input_ids": [5] * 17, "attention_mask": [1] * 17, "labels": [6] * 9},
        {"input_ids": [5] * 20, "attention_mask": [1] * 20, "labels": [6] * 10},
    ]
    batch = collator(features)
    assert batch["input_ids"].shape == (2, 40) and batch["attention_mask"].shape == (2, 40)
    assert batch["labels"].shape == (2, 24)
    assert int(batch["attention_mask"].sum()) == 37
    assert (batch["labels"][:, 10:] == LABEL_PAD_TOKEN_ID).all()
    assert (batch["input_ids"][0, 17:] == tokenizer.pad_token_id).all()
    assert isinstance(batch["input_ids"], torch.Tensor)


@pytest.fixture(scope="module")
def sample_lengths(tmp_path_factory) -> tuple[list[int], list[int]]:
    """(source, target) lengths of the shipped sample's 1,000 training questions, prepared as training is (schema input)."""
    import datasets

    from textsql.data.prepare import PrepareArguments, prepare

    out = tmp_path_factory.mktemp("sample") / "data"
    prepare(PrepareArguments(data_dir=str(out)))
    train = datasets.load_from_disk(str(out))["train"]
    return [len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]]


def padding_share(lengths, source_bounds, target_bounds) -> float:
    real = sum(lengths[0]) + sum(lengths[1])
    padded = sum(padded_length(s, source_bounds) + padded_length(t, target_bounds) for s, t in zip(*lengths))
    return 1 - real / padded


def test_an_overflow_bucket_for_the_longest_2_percent_cuts_the_samples_padding(sample_lengths):
    sources, targets = sample_lengths
    # The bounds before: the top bucket reached the longest example (top quantile 1), so the targets had two
    # buckets, 24 and 88 tokens, for queries of 9 to 87 tokens, 98 % of them within 34.
    before = padding_share(sample_lengths, bucket_bounds(sources, top=1.0), bucket_bounds(targets, top=1.0))
    now = sampler(sample_lengths)
    after = padding_share(sample_lengths, now.source_bounds, now.target_bounds)
    assert before > 0.3 and after < 0.2, (before, after)
    assert now.target_bounds[-1] == round_up(max(targets)) and len(now.target_bounds) > 2
    # Still a fixed, small set of shapes: at most two per (source, target) bucket, 5 x 5 buckets.
    assert len(now.shapes()) <= 2 * len(now.groups) <= 2 * 5 * 5


@pytest.mark.parametrize("max_norm", [0.01, 0.0])
def test_the_optimizer_clips_before_its_step_when_asked(tmp_path, max_norm):
    from transformers import Seq2SeqTrainingArguments

    from textsql.model import load_model
    from textsql.training.batching import TokenBudgetTrainer

    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0, learning_rate=0.0, report_to=[])
    model = load_model()
    trainer = TokenBudgetTrainer(model=model, args=args, optimizer_max_grad_norm=max_norm)
    optimizer = trainer.create_optimizer()
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert (norm.item() <= 0.0101) is (max_norm > 0)


def one_block_model() -> torch.nn.Module:
    """The embedded T5 with one block a side, for evaluation: Dynamo traces half the layers, and what a block breaks
    a graph on is still counted once per shape."""
    from transformers import AutoConfig, T5ForConditionalGeneration

    config = AutoConfig.from_pretrained(DEFAULT_MODEL_DIR, num_layers=1, num_decoder_layers=1)
    return T5ForConditionalGeneration(config).eval()


@pytest.mark.slow
@pytest.mark.parametrize("bucketed", [True, False])
def test_torch_compile_compiles_once_per_bucket_shape_over_an_epoch(bucketed):
    """Dynamo compiles each new input shape once; bucket padding bounds the shapes an epoch can bring.

    Padding each batch to its longest member instead (bucketed=False) brings more shapes than the
    sampler predicts, and the bound fails, as it should.
    """
    from textsql.model import load_tokenizer

    rng = random.Random(3)
    sources, targets = [rng.randint(6, 60) for _ in range(120)], [rng.randint(3, 30) for _ in range(120)]
    # Two buckets a side keep the shapes (and Dynamo's tracing, tens of seconds each here) few.
    sampler = TokenBudgetBatchSampler(sources, targets, max_tokens=1024, buckets=2, seed=1)
    tokenizer = load_tokenizer()
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=LABEL_PAD_TOKEN_ID, pad_to_multiple_of=8)
    if bucketed:
        collator = BucketPadding(collator, sampler.source_bounds, sampler.target_bounds, tokenizer.pad_token_id)
    examples = [
        {"input_ids": [5] * source, "attention_mask": [1] * source, "labels": [6] * target}
        for source, target in zip(sources, targets)
    ]
    compiled_graphs = []

    def counting_backend(graph, example_inputs):
        compiled_graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    step = torch.compile(one_block_model(), backend=counting_backend, dynamic=False)
    shapes = set()
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096), torch.no_grad():
        for batch_indices in sampler:
            batch = collator([examples[i] for i in batch_indices])
            shapes.add((*batch["input_ids"].shape, batch["labels"].shape[1]))
            step(**batch)
            if len(shapes) == 1:
                graphs_per_shape = len(compiled_graphs)  # graph breaks make it more than one per shape
            if len(compiled_graphs) > graphs_per_shape * len(sampler.shapes()):
                break  # past the bound: the rest of the epoch would only add compilations
    torch._dynamo.reset()
    assert len(compiled_graphs) == graphs_per_shape * len(shapes)
    within = len(compiled_graphs) <= graphs_per_shape * len(sampler.shapes())
    assert within is bucketed, (len(shapes), len(sampler.shapes()))


def test_no_batch_holds_a_single_example_where_the_budget_allows_two():
    """Dynamo compiles a batch of one example apart (it specializes a dimension of size 1): a bucket's last example
    shares the last batch, a bucket of one example joins the smallest bucket that holds it."""
    assert batch_lengths(7, 3) == [3, 2, 2] and batch_lengths(6, 3) == [3, 3] and batch_lengths(1, 3) == [1]
    assert batch_lengths(5, 2) == [2, 2, 1]  # two and one: three would be over the budget
    # 13 short examples (budget 96 // 16: six a batch, one left over), 6 long ones (96 // 32: three a batch) and one
    # alone in its (short source, long target) bucket, which joins the long ones' bucket.
    sources, targets = [8] * 13 + [16] * 6 + [8], [8] * 13 + [16] * 6 + [16]
    sampler = TokenBudgetBatchSampler(sources, targets, 96, buckets=2, seed=3)
    assert sorted(sampler.groups) == [(8, 8), (16, 16)] and 19 in sampler.groups[(16, 16)]
    batches = list(sampler)
    assert sorted(index for batch in batches for index in batch) == list(range(20))
    by_bucket = {key: sorted(len(b) for b in batches if b[0] in group) for key, group in sampler.groups.items()}
    assert by_bucket == {(8, 8): [3, 4, 6], (16, 16): [2, 2, 3]}
    for batch in batches:
        key = next(key for key, group in sampler.groups.items() if batch[0] in group)
        assert all(index in sampler.groups[key] for index in batch) and len(batch) * sum(key) <= 96
    assert sampler.shapes() == {(6, 8, 8), (4, 8, 8), (3, 8, 8), (3, 16, 16), (2, 16, 16)}


@pytest.mark.parametrize("compiled, budget", [(True, 1024), (False, 1024), (True, None)])
def test_the_trainer_marks_token_budget_batches_dynamic_only_when_it_compiles(tmp_path, monkeypatch, compiled, budget):
    from transformers import Seq2SeqTrainingArguments

    from textsql.model import load_model
    from textsql.training import batching

    marked = []
    monkeypatch.setattr(batching, "mark_batch_dynamic", marked.append)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), torch_compile=compiled, report_to=[], use_cpu=True)
    trainer = batching.TokenBudgetTrainer(model=load_model(), args=args, max_tokens_per_batch=budget)
    prepared = trainer._prepare_inputs({"input_ids": torch.ones(2, 8, dtype=torch.long)})
    assert marked == ([prepared] if compiled and budget else [])


@pytest.mark.slow
@pytest.mark.parametrize("marked", [True, False])
def test_a_token_budget_epoch_compiles_once_with_its_dimensions_marked_dynamic(marked):
    """What the trainer does under torch.compile (mark_batch_dynamic on each batch): dynamo's first compilation
    serves every bucket's shape. Unmarked, dynamo compiles the first shape as it is and again when it changes."""
    from textsql.model import load_tokenizer

    rng = random.Random(3)
    sources, targets = [rng.randint(6, 60) for _ in range(120)], [rng.randint(3, 30) for _ in range(120)]
    sampler = TokenBudgetBatchSampler(sources, targets, max_tokens=1024, buckets=2, seed=1)
    tokenizer = load_tokenizer()
    collator = BucketPadding(
        DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=LABEL_PAD_TOKEN_ID, pad_to_multiple_of=8),
        sampler.source_bounds,
        sampler.target_bounds,
        tokenizer.pad_token_id,
    )
    examples = [
        {"input_ids": [5] * source, "attention_mask": [1] * source, "labels": [6] * target}
        for source, target in zip(sources, targets)
    ]
    compilations = []

    def counting_backend(graph, example_inputs):
        compilations.append(graph)
        return graph.forward

    torch._dynamo.reset()
    step = torch.compile(one_block_model(), backend=counting_backend)
    shapes, after_first = set(), None
    with torch.no_grad():
        for batch_indices in sampler:
            batch = collator([examples[i] for i in batch_indices])
            if marked:
                mark_batch_dynamic(batch)
            shapes.add((*batch["input_ids"].shape, batch["labels"].shape[1]))
            step(**batch)
            after_first = after_first or len(compilations)  # graph breaks make it more than one graph
            if not marked and len(compilations) > after_first:
                break  # recompiled: what marking prevents
    torch._dynamo.reset()
    assert (len(compilations) == after_first) is marked, (len(compilations), after_first, len(shapes))
    assert len(shapes) > 2 or not marked  # marked, a whole epoch of shapes ran on the first compilation


def step_examples(group_size: int, ranks: int, batch: int, accumulation: int, lengths: list[int]) -> list[set[int]]:
    """The examples of each optimizer step when ``ranks`` ranks draw from one length-grouped order as the
    trainer's loader does (accelerate gives rank r every ranks-th batch; a step is ``accumulation`` of them)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler
    from transformers.trainer_pt_utils import LengthGroupedSampler

    per_rank = []
    for rank in range(ranks):
        torch.manual_seed(7)  # set_seed before the epoch's order is drawn, on every rank
        sampler = BatchSampler(LengthGroupedSampler(group_size, lengths=lengths), batch, drop_last=False)
        per_rank.append(list(BatchSamplerShard(sampler, num_processes=ranks, process_index=rank)))
    steps = len(per_rank[0]) // accumulation
    return [
        {
            index
            for shard in per_rank
            for micro in shard[step * accumulation : (step + 1) * accumulation]
            for index in micro
        }
        for step in range(steps)
    ]


def test_fewer_ranks_see_the_same_examples_in_each_step_when_the_length_groups_keep_their_size():
    """What --length_group_size is for: 3 ranks x 4 and 2 ranks x 3 x 2 accumulation take the same 12
    questions a step only if the length groups do not follow the per-rank batch (transformers' default)."""
    lengths = [random.Random(index).randint(5, 90) for index in range(72)]
    three = step_examples(4, ranks=3, batch=4, accumulation=1, lengths=lengths)
    assert step_examples(4, ranks=2, batch=3, accumulation=2, lengths=lengths) == three
    assert step_examples(3 * 2, ranks=2, batch=3, accumulation=2, lengths=lengths) != three
