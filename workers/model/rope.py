"""Rotary position embeddings: default and llama3 frequency scaling, applied rotate-half style.
The cos/sin tables are float32 whatever the weights' dtype, computed on the device they serve:
rounded through bf16 they would be off by up to 2^-9, an error every rotated q and k would carry.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    # float32 throughout, as the reference implementation computes it, so logits match bit-closely.
    # On the host whatever the default device (a model built on "meta" still needs real values).
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(
            f"rope_type {kind!r} is not supported (supported: default, linear, llama3)"
        )
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    smooth = ((original / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    in_band = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(in_band, blended, scaled)


def rope_tables(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, `[max_positions, head_dim // 2]` in float32, computed on `device` (default:
    torch's default device)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)
    return freqs.cos(), freqs.sin()


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (no per-step trig)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        cos, sin = rope_tables(head_dim, max_positions, theta, scaling, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """Compute the tables afresh, in float32, on `device`: for a model built on the meta
        device, whose tables are shapes alone. (Casting them would round the angles through the
        cast's dtype; `Module.to_empty` would leave garbage.)"""
        self.cos, self.sin = rope_tables(
            self.head_dim, self.max_positions, self.theta, self.scaling, device
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
