"""Picks the attention backend for a device: flash-attn on CUDA, torch SDPA elsewhere."""

from __future__ import annotations

import torch

from workers.model.attention.base import AttentionBackend

BACKENDS = ("auto", "torch", "torch-sdpa", "flash-attn")


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is unknown (choose from {', '.join(BACKENDS)})"
        )
    if name == "auto":
        name = "flash-attn" if device.type == "cuda" else "torch"
    if name == "flash-attn":
        if device.type != "cuda":
            raise ValueError("the flash-attn backend runs on CUDA devices only; use --device cuda")
        from workers.model.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend()
    from workers.model.attention.torch_backend import TorchAttentionBackend

    # "torch-sdpa" keeps decode attention in SDPA even where the CPU kernel is available.
    return TorchAttentionBackend(device, use_kernel=name == "torch")
