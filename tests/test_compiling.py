"""What a rank does under torch.compile (textsql.training.compiling) and the batches it compiles for: regional
compilation and a private compile cache where the launch did not say otherwise, one shape a bucket, and a training
step that builds no generation cache, and an evaluation that compiles nothing."""

import os
import random
import stat
from collections import Counter

import pytest
import torch

from textsql.training.batching import COMPILED_ALIGN, TokenBudgetBatchSampler, TokenBudgetTrainer
from textsql.training.compiling import (
    CACHE_VAR,
    DYNAMIC_VAR,
    REGIONAL_VAR,
    compile_cache_dir,
    prepare_compilation,
)


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    """No compile variables set, and a cache home of the test's own."""
    for name in (REGIONAL_VAR, DYNAMIC_VAR, CACHE_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))
    return tmp_path / "cache-home"


def test_a_compiled_rank_compiles_by_regions_into_a_private_cache_that_outlives_the_pod(clean_environment):
    settings = prepare_compilation(True)
    cache = clean_environment / "textsql" / "torch-compile"
    assert settings == {REGIONAL_VAR: "true", DYNAMIC_VAR: "true", CACHE_VAR: str(cache)}
    assert compile_cache_dir() == cache and all(os.environ[name] == value for name, value in settings.items())
    # Code every rank imports and runs: no other user may write into it.
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_what_the_launch_set_wins_and_an_eager_rank_changes_nothing(clean_environment, monkeypatch, tmp_path):
    assert prepare_compilation(False) == {}
    assert not any(name in os.environ for name in (REGIONAL_VAR, DYNAMIC_VAR, CACHE_VAR))
    theirs = {REGIONAL_VAR: "false", DYNAMIC_VAR: "false", CACHE_VAR: str(tmp_path / "theirs")}
    for name, value in theirs.items():
        monkeypatch.setenv(name, value)
    assert prepare_compilation(True) == theirs
    assert not clean_environment.exists() and not (tmp_path / "theirs").exists()  # Inductor creates its own


def test_a_home_without_room_for_the_cache_leaves_it_where_torch_keeps_it(clean_environment, caplog):
    clean_environment.parent.mkdir(exist_ok=True)
    clean_environment.write_text("a file where the cache's parent directory would be")
    assert prepare_compilation(True)[CACHE_VAR] == "" and CACHE_VAR not in os.environ
    assert f"set {CACHE_VAR} where you launch" in caplog.text


@pytest.fixture(scope="module")
def lengths() -> tuple[list[int], list[int]]:
    """1,000 (source, target) lengths around WikiSQL's, and a long tail."""
    generator = random.Random(11)
    sources = [min(200, max(20, int(generator.gauss(65, 25)))) for _ in range(1000)]
    targets = [min(80, max(8, int(generator.gauss(22, 9)))) for _ in range(1000)]
    return sources, targets


@pytest.mark.parametrize("ranks", [1, 3])
def test_compiled_batches_have_one_shape_a_bucket_cover_every_example_and_stay_in_the_budget(lengths, ranks):
    budget = 2048
    samplers = [
        TokenBudgetBatchSampler(*lengths, budget, seed=5, num_replicas=ranks, rank=rank, compiled=True)
        for rank in range(ranks)
    ]
    first = samplers[0]
    assert all(bound % COMPILED_ALIGN == 0 for bound in (*first.source_bounds, *first.target_bounds))
    shapes_seen, seen = set(), Counter()
    for epoch in (0, 1):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = [batch for sampler in samplers for batch in sampler]
        assert len({len(list(sampler)) for sampler in samplers}) == 1  # every rank steps alike
        for batch in batches:
            key = next(key for key, group in first.groups.items() if batch[0] in group)
            assert all(index in first.groups[key] for index in batch)
            assert len(batch) == first.batch_sizes[key] and len(batch) * sum(key) <= budget
            shapes_seen.add((len(batch), *key))
        seen.update(index for batch in first.epoch_batches(epoch) for index in batch)
    assert shapes_seen == first.shapes() and len(first.shapes()) == len(first.groups)  # one shape a bucket
    assert set(seen) == set(range(1000))
    # Topping up repeats at most a batch less one example of each bucket an epoch.
    repeats = sum(seen.values()) - 2 * 1000
    assert 0 < repeats <= 2 * sum(size - 1 for size in first.batch_sizes.values())


def test_a_bucket_smaller_than_a_full_batch_is_one_batch_of_its_own_examples():
    # 202 short examples (budget 256 // 32: 8 a batch, the last topped up) and 3 long ones in the overflow bucket
    # (256 // 64: 4 a batch, only 3 there).
    sources, targets = [8] * 202 + [48] * 3, [8] * 202 + [16] * 3
    sampler = TokenBudgetBatchSampler(sources, targets, 256, buckets=1, seed=2, compiled=True)
    assert sampler.batch_sizes == {(16, 16): 8, (48, 16): 3}
    batches = sorted(sampler, key=len)
    assert sorted(batches[0]) == [202, 203, 204] and [len(batch) for batch in batches] == [3] + [8] * 26


def test_a_training_step_builds_no_generation_cache(tmp_path):
    from transformers import Seq2SeqTrainingArguments

    from textsql.model import load_model

    model = load_model()
    calls = []
    model.decoder.register_forward_hook(
        lambda module, args, kwargs, output: calls.append((kwargs.get("use_cache"), output.past_key_values)),
        with_kwargs=True,
    )
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = TokenBudgetTrainer(model=model, args=args)
    trainer.current_gradient_accumulation_steps = 1  # as trainer.train() sets it before its first step
    inputs = {"input_ids": torch.tensor([[5, 6, 1]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    inputs["labels"] = torch.tensor([[7, 8, 1]])
    loss = trainer.training_step(model.train(), inputs)
    assert loss.item() > 0 and calls == [(False, None)]
    model(**inputs)  # what the trainer leaves out: T5 on its own fills a cache even while training
    assert calls[-1][1] is not None


def test_the_trainer_hands_accelerate_regions_and_dynamic_sizes(clean_environment, tmp_path):
    """The variables reach the libraries: accelerate's dynamo plugin, which compiles the DeepSpeed engine's module,
    reads them when the trainer builds its accelerator."""
    from transformers import Seq2SeqTrainingArguments

    from textsql.model import load_model

    prepare_compilation(True)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, torch_compile=True)
    plugin = TokenBudgetTrainer(model=load_model(), args=args).accelerator.state.dynamo_plugin
    assert plugin.use_regional_compilation is True and plugin.dynamic is True and plugin.backend.value == "INDUCTOR"


def regions_compiled(dynamic: bool | None) -> tuple[torch.nn.Module, list]:
    """The embedded T5 in training mode, compiled as a rank compiles it (accelerate's regional compilation of the
    engine's module), and the list its counting backend appends each graph compiled to."""
    from accelerate.utils.other import compile_regions_deepspeed

    from textsql.model import load_model
    from textsql.model.speedups import speed_up_training

    graphs: list = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = load_model().train()
    speed_up_training(model)  # as textsql.training.train.model_to_train hands it to the trainer
    compile_regions_deepspeed(model, backend=counting_backend, dynamic=dynamic)
    return model, graphs


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [True, None])
def test_regions_compiled_with_dynamic_sizes_compile_nothing_after_the_first_batch(dynamic):
    """What a compiled rank runs (accelerate's regional compilation of the engine's module), on the embedded T5's two
    blocks a side: with dynamic sizes every graph is compiled for the first batch; without, each block is compiled
    again for the second batch's sizes, which the marks on the batch cannot reach."""
    from textsql.training.compiling import mark_batch_dynamic

    model, graphs = regions_compiled(dynamic)
    after_first = None
    # Not 4 examples first: the embedded T5 has 4 heads, and dynamo then fixes the batch's size to 4 (it compiled
    # again for 6 where 5 first did not).
    for examples, source, target in ((5, 24, 8), (6, 16, 16), (3, 40, 8)):
        batch = {
            "input_ids": torch.randint(2, 100, (examples, source)),
            "attention_mask": torch.ones(examples, source, dtype=torch.long),
            "labels": torch.randint(2, 100, (examples, target)),
        }
        mark_batch_dynamic(batch)
        model(**batch, use_cache=False).loss.backward()
        after_first = len(graphs) if after_first is None else after_first
    torch._dynamo.reset()
    assert (len(graphs) == after_first) is bool(dynamic), (len(graphs), after_first)


def test_an_evaluation_compiles_nothing_after_the_training_steps(tmp_path):
    """Regions compiled for training steps, then the run's evaluation: its loss in eval mode without gradients, and
    generation, whose cache grows a token at a time. Compiled, each changes a guard of every block (8 compilations
    of the embedded T5's blocks by the first evaluation, dynamo's limit); the run's trainer evaluates eagerly."""
    import datasets
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

    from textsql.model import load_tokenizer
    from textsql.training.trainer import GrammarSeq2SeqTrainer

    model, graphs = regions_compiled(dynamic=True)
    tokenizer = load_tokenizer()
    batch = {"input_ids": torch.randint(2, 100, (5, 24)), "labels": torch.randint(2, 100, (5, 8))}
    model(**batch, use_cache=False).loss.backward()
    trained = len(graphs)
    questions = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 1], [8, 9, 1]], "labels": [[7, 8, 1], [5, 1]]})
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        predict_with_generate=True,
        generation_max_length=6,
        per_device_eval_batch_size=2,
    )
    trainer = GrammarSeq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=questions,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    metrics = trainer.evaluate()
    torch._dynamo.reset()
    assert trained > 0 and "eval_loss" in metrics
    assert len(graphs) == trained, f"{len(graphs) - trained} graphs compiled by the evaluation"


def test_a_compiled_block_runs_a_ranks_t5_as_one_graph():
    """A compiled region takes transformers' own SDPA attention and T5's own linear layers inside the rank's changes
    (no graph break), and computes what the eager block does."""
    from textsql.model import load_model
    from textsql.model.speedups import speed_up_training

    torch._dynamo.reset()
    model = load_model().train()
    speed_up_training(model)
    hidden = torch.randn(3, 7, model.config.d_model)
    position_bias = model.encoder.block[0].layer[0].SelfAttention.compute_bias(7, 7)
    padding = torch.zeros(3, 1, 1, 7).masked_fill_(torch.arange(7) >= 5, torch.finfo(torch.float32).min)
    block = model.encoder.block[1]
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    torch.manual_seed(0)
    expected = block(hidden, padding, position_bias)[0]
    torch.manual_seed(0)
    assert torch.equal(compiled(hidden, padding, position_bias)[0], expected)
    torch._dynamo.reset()
