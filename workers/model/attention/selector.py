"""Picks the attention backend for a device. `auto`: flash-attn on CUDA where it is installed
and takes the config (dtype, block size, head size, GPU generation), else the paged torch
backend (a Triton decode kernel on CUDA, Tandem's compiled kernels on CPU); the choice, and
why flash-attn was passed over, is logged once at start, never found out mid-step."""

from __future__ import annotations

import logging

import torch

from workers.model.attention.base import AttentionBackend, HeadShape
from workers.model.flash_rules import ATTENTION_BACKENDS, flash_refusal

log = logging.getLogger(__name__)


def choose_backend(
    name: str,
    device_type: str,
    flash_missing: str | None,
    dtype: str | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
    capability: tuple[int, int] | None = None,
) -> tuple[str, str]:
    """(the backend to build, why: for `auto`, why flash-attn was or was not taken).
    `flash_missing`: why flash-attn cannot be imported here, or None if it can."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is unknown (choose from {', '.join(ATTENTION_BACKENDS)})"
        )
    if name == "flash-attn" and device_type != "cuda":
        raise ValueError("the flash-attn backend runs on CUDA devices only; use --device cuda")
    if name != "auto":
        return name, "asked for"
    if device_type != "cuda":
        return "torch", f"flash-attn is for CUDA, not {device_type}"
    why = flash_missing or flash_refusal(dtype, block_size, head_dim, capability)
    if why is None:
        return "flash-attn", "installed, and takes this config"
    return "torch", why


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
    heads: tuple[int, int] | None = None,
) -> AttentionBackend:
    """The backend `name` picks on `device` for a model of `heads` (query heads, KV heads)
    of head_dim, its cache in `dtype` blocks of block_size (each None: not checked)."""
    missing = capability = None
    if name == "auto" and device.type == "cuda":
        from workers.model.attention.flash_backend import flash_attn_unavailable

        missing = flash_attn_unavailable()
        capability = torch.cuda.get_device_capability(device)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
    chosen, why = choose_backend(
        name, device.type, missing, dtype_name, block_size, head_dim, capability
    )
    if chosen == "flash-attn":
        from workers.model.attention.flash_backend import FlashAttentionBackend

        backend = FlashAttentionBackend()
    else:
        from workers.model.attention.torch_backend import TorchAttentionBackend

        # "torch-sdpa" keeps decode attention in SDPA even where a paged kernel is available.
        shape = None
        if None not in (heads, head_dim, block_size, dtype):
            shape = HeadShape(heads[0], heads[1], head_dim, block_size, dtype)
        backend = TorchAttentionBackend(device, use_kernel=chosen == "torch", shape=shape)
    if name == "auto" and device.type == "cuda":
        log.info("attention on %s: %s (flash-attn: %s)", device, backend.name, why)
    return backend
