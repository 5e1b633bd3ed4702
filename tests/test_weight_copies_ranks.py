"""bf16 weight copies through DeepSpeed's engine on two ranks: the gradients reach the fp32 weights before the engine
all-reduces them, so every rank steps as it would with autocast's own casts (textsql/model/weight_copies.py)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.network import free_port

RANK_PROGRAM = textwrap.dedent(
    """
    import json, os, sys
    import deepspeed, torch
    from textsql.model import speedups
    from textsql.training.loss import training_model

    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch
    batch = {"input_ids": torch.randint(5, 32000, (4, 23), generator=generator)}
    batch["labels"] = torch.randint(5, 32000, (4, 11), generator=generator)
    result = {}
    for copies in (False, True):
        model = training_model(None, "full")
        changed = speedups.speed_up_training(model) if copies else None
        if not copies:
            for change in (speedups.fuse_norms, speedups.skip_feed_forward_upcast, speedups.share_attention_bias,
                           speedups.fuse_projections):
                change(model)
        config = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 1,
                  "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
        # A rank's default optimizer: its step changes the weights without counting a change in their version.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        losses = []
        for micro_batch in range(6):
            torch.manual_seed(micro_batch)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
        result[copies] = (losses, weights, changed)
    (without, with_copies) = result[False], result[True]
    print(json.dumps({
        "copies": with_copies[2]["linear layers computing from bf16 weight copies"],
        "losses_equal": without[0] == with_copies[0],
        "weights_equal": all(torch.equal(without[1][name], with_copies[1][name]) for name in without[1]),
        "weights_moved": not all(torch.equal(without[1][name], training_model(None, "full").state_dict()[name])
                                 for name in without[1]),
    }))
    """
)


@pytest.mark.slow
def test_two_ranks_step_with_weight_copies_to_the_bits_of_autocasts_casts(tmp_path: Path):
    """Two ranks, each its own batch, two micro-batches an optimizer step of torch's fused AdamW: the losses and the
    all-reduced weights after three steps are the same bits with and without the copies, on each rank."""
    program = tmp_path / "ranks.py"
    program.write_text(RANK_PROGRAM)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(program),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"copies"')]
    assert len(ranks) == 2, result.stdout[-2000:]
    for rank in ranks:
        assert rank == {"copies": rank["copies"], "losses_equal": True, "weights_equal": True, "weights_moved": True}
        assert rank["copies"] > 0
