"""python -m bench norms (bench/norms.py): T5's own norms against torch's RMSNorm in the same training steps."""

import json

from bench import norms


def test_the_norms_figure_swaps_every_norm_and_dispatches_fewer_operators_a_step(tmp_path):
    out = tmp_path / "norms.json"
    assert norms.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (figure,) = result["shapes"].values()
    # The embedded T5: 2 encoder and 2 decoder blocks, a norm before each attention and feed-forward, one at each end.
    assert figure["model"] == "t5-tiny" and figure["norms_swapped"] == (2 * 2 + 1) + (3 * 2 + 1)
    own, fused = (figure["arms"][name]["timeline"] for name in norms.ARMS)
    assert own["activity"] == fused["activity"] == "CPU: top-level ATen operators"
    # On a CPU torch's RMSNorm is one top-level operator where T5's norm dispatches several; its backward and its
    # kernels on CUDA are what a GPU run measures.
    assert figure["kernels_per_step_saved"] == own["kernels_per_step"] - fused["kernels_per_step"]
    assert figure["kernels_per_step_saved"] >= 5 * figure["norms_swapped"]
    assert figure["arms"]["t5_norms"]["median_step_ms"] > 0 and figure["t5_norms_over_fused_step"] > 0
    assert result["releases"]["torch"] and "alternating" in result["method"]
