from pathlib import Path

import pytest
import torch

from textsql.errors import ModelError
from textsql.model import has_weights, load_model, load_tokenizer, resolve_model


def test_embedded_tokenizer_is_the_real_t5_vocabulary():
    tokenizer = load_tokenizer()
    assert tokenizer.is_fast
    assert len(tokenizer) == 32100
    ids = tokenizer("SELECT Notes FROM table").input_ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids


def test_embedded_model_is_small_and_deterministic():
    first, second = load_model(), load_model()
    assert 1e6 < first.num_parameters() < 2e7
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(load_model(seed=1).parameters()), next(first.parameters()))


def test_saved_model_round_trips(tmp_path: Path):
    model = load_model()
    model.save_pretrained(tmp_path)
    assert has_weights(tmp_path)
    reloaded = load_model(tmp_path)
    assert torch.equal(reloaded.shared.weight, model.shared.weight)


def test_missing_local_directory_names_the_flag(tmp_path: Path):
    with pytest.raises(ModelError, match="--model"):
        resolve_model(str(tmp_path / "nope"))


def test_unreadable_tokenizer_is_one_clear_error(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ModelError, match="no tokenizer in"):
        load_tokenizer(tmp_path)
