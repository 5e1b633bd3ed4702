"""Training FLOPs of a T5 sample counted the encoder-decoder way, and model FLOPs utilisation.

Not ``6 x parameters x tokens``: an encoder-decoder spends different parameters on each side. Per
source token the encoder's layers and each decoder layer's cross-attention K/V projection
(``N_enc``); per target token the decoder's self-attention, cross-attention Q/O, feed-forward and the
tied vocabulary head (``N_dec``). A training step is 3x a forward pass (forward + backward), and a
multiply-add is 2 FLOPs, hence the 6 in::

    FLOPs(sample) = 6 x (N_enc x L_enc + N_dec x L_dec)
                  + 12 x d_attn x (layers_enc x L_enc^2 + layers_dec x (L_dec^2 + L_dec x L_enc))

The second line is the attention scores and their weighted sums (QK^T and AV), with no discount for
the decoder's causal mask. For t5-small: N_enc 22.0M, N_dec 38.5M, 13.9 GFLOP at L_enc 65 / L_dec 22
(13.7 without the attention term). MFU on real tokens uses each sample's unpadded lengths, so padding
never counts as useful work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's data sheets, keyed by the exact name CUDA reports
# (torch.cuda.get_device_name): the SXM and PCIe cards of one chip differ (H100 SXM 989, PCIe 756, NVL 835).
PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10": 125e12,
    "NVIDIA A10G": 70e12,
}
# A CPU has no data-sheet peak here: the smoke run's stand-in is cores x 2 GHz x 32 fp32 FLOP a cycle
# (two AVX2 FMA units), a round nominal figure so the MFU code path runs, not a measurement.
CPU_FLOPS_PER_CORE = 2.0e9 * 32
FLOP_CONVENTION = (
    "6 x (N_enc x L_enc + N_dec x L_dec) + attention scores, per sample at the unpadded lengths it trains at, the "
    "full-vocabulary output layer included (bench/flops.py)"
)


@dataclass(frozen=True)
class T5Shape:
    """The sizes that set a T5's FLOPs."""

    d_model: int
    d_attention: int  # heads x d_kv
    d_ff: int
    encoder_layers: int
    decoder_layers: int
    vocab_size: int
    gated: bool = False  # gated-GELU feed-forward (T5 v1.1) has a third d_model x d_ff matrix

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> T5Shape:
        """:rtype: T5Shape"""
        return cls(
            d_model=config.d_model,
            d_attention=config.num_heads * config.d_kv,
            d_ff=config.d_ff,
            encoder_layers=config.num_layers,
            decoder_layers=config.num_decoder_layers or config.num_layers,
            vocab_size=config.vocab_size,
            gated=bool(getattr(config, "is_gated_act", False)),
        )

    @property
    def feed_forward(self) -> int:
        return (3 if self.gated else 2) * self.d_model * self.d_ff

    @property
    def encoder_parameters_per_token(self) -> int:
        """Parameters each source token passes through: encoder layers and the decoder's cross-attention K/V."""
        attention = 4 * self.d_model * self.d_attention
        return (
            self.encoder_layers * (attention + self.feed_forward)
            + self.decoder_layers * 2 * self.d_model * self.d_attention
        )

    @property
    def decoder_parameters_per_token(self) -> int:
        """Parameters each target token passes through: decoder self-attention, cross Q/O, feed-forward, head."""
        layer = 4 * self.d_model * self.d_attention + 2 * self.d_model * self.d_attention + self.feed_forward
        return self.decoder_layers * layer + self.vocab_size * self.d_model


def training_flops(shape: T5Shape, source_tokens: int, target_tokens: int, attention: bool = True) -> float:
    """FLOPs of one training sample (forward and backward) of the given unpadded lengths.

    :param attention: include the attention scores and weighted sums (the quadratic term).
    :rtype: float
    """
    flops = 6 * (
        shape.encoder_parameters_per_token * source_tokens + shape.decoder_parameters_per_token * target_tokens
    )
    if attention:
        quadratic = shape.encoder_layers * source_tokens**2 + shape.decoder_layers * (
            target_tokens**2 + target_tokens * source_tokens
        )
        flops += 12 * shape.d_attention * quadratic
    return float(flops)


def peak_flops(device_name: str | None, cpu_cores: int | None = None) -> float | None:
    """Dense bf16 peak of a GPU by its exact CUDA name; for ``"cpu"`` the nominal :data:`CPU_FLOPS_PER_CORE`
    x ``cpu_cores``; ``None`` for a device not in :data:`PEAK_BF16_FLOPS` (MFU is then left out).

    :rtype: float | None
    """
    if device_name == "cpu":
        return CPU_FLOPS_PER_CORE * (cpu_cores or 1)
    peak = PEAK_BF16_FLOPS.get(device_name or "")
    if peak is None:
        logger.warning(
            "no peak FLOP/s for device %r; add its data-sheet figure to bench.flops.PEAK_BF16_FLOPS", device_name
        )
    return peak


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: useful FLOPs per second over the device's peak (a fraction, not %).

    :rtype: float | None
    """
    return None if not peak or seconds <= 0 else flops / seconds / peak
