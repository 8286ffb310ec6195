"""A GGUF's Q8_0, Q4_0 and Q4_1 linear weights served as stored (quantization: gguf), by the
int8 kernel's block formats (csrc/linear_int8_cpu.cpp, `linear_blocks`): about half (Q8_0) and
a quarter (the 4-bit types) of bf16's bytes per decode step. gguf_loader.py decides which
layers come as blocks; here they are packed and put in their layers."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from workers.model.cpu_kernels import cpu_kernels
from workers.model.int8_linear import int8_kernel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockWeight:
    """A GGUF weight served as stored, packed for `linear_blocks`: w = d * q (Q8_0),
    d * (q - 8) (Q4_0) or d * q + m (Q4_1), d and m per output and 32 inputs."""

    packed: torch.Tensor  # uint8: [N/32, K/4, 32, 4] (Q8_0, q + 128) or [N/32, K/8, 32, 4]
    d: torch.Tensor  # fp16 [N/32, K/32, 32]
    m: torch.Tensor  # fp16 as d (Q4_1), or empty (Q8_0, Q4_0)
    four_bit: bool
    types: tuple[str, ...]  # the GGUF types it came in (q, k and v may differ)
    portable: bool
    kernels: object  # the built CPU kernels (cpu_kernels.py)
    bias: torch.Tensor | None = None  # the layer's own (Qwen2's q, k and v), added after

    def matmul(self, rows: torch.Tensor, float_out: bool) -> torch.Tensor:
        out = self.kernels.linear_blocks(
            rows, self.packed, self.d, self.m, self.four_bit, float_out, self.portable
        )
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _block_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, K/32] per-block values into the kernel's [N/32, K/32, 32]."""
    n, groups = s.shape
    return s.view(n // 32, 32, groups).transpose(1, 2).contiguous()


def pack_stored(blocks, kernels, portable: bool) -> BlockWeight | None:
    """One GGUF weight's blocks (gguf_loader.StoredBlocks) packed for the kernel, or None where
    its outputs are not a multiple of 32."""
    n = blocks.q.shape[0]
    if n % 32:
        return None
    pack = kernels.pack_linear_int4 if blocks.four_bit else kernels.pack_linear_int8
    m = _block_scales(blocks.m) if blocks.m is not None else torch.empty(0, dtype=torch.half)
    return BlockWeight(
        pack(blocks.q),
        _block_scales(blocks.d),
        m,
        blocks.four_bit,
        (blocks.type_name,),
        portable,
        kernels,
    )


def _concat(parts: list[BlockWeight]) -> BlockWeight:
    """Weights of one type stacked along their outputs (q, k and v into one), blocks of 32
    outputs apiece."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return BlockWeight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.d for p in parts]),
        torch.cat([p.m for p in parts]) if first.m.numel() else first.m,
        first.four_bit,
        tuple(t for p in parts for t in p.types),
        first.portable,
        first.kernels,
    )


def serve_stored(model: nn.Module, stored: dict) -> int:
    """Every linear layer of `model` whose checkpoint tensors came as stored GGUF blocks
    (`stored`: BlockWeight by HF name less `model.`, from `pack_stored`; all of a layer's
    parts or none, in one type), served by them as they are; returns how many. The rest keep
    the model's dtype, for `pack_linears`, with a log line saying which and why. The caller
    checks the device (`int8_unavailable`) before the blocks are packed."""
    kernels = cpu_kernels()
    done, left = 0, []
    for module, names in model.linear_sources():
        parts = [stored.get(n) for n in names]
        if all(p is None for p in parts):
            left.append(names[0].rsplit(".", 2)[0] if len(names) > 1 else names[0])
            continue
        if any(p is None for p in parts) or len({p.types for p in parts}) > 1:
            # gguf_loader.served_as_stored sends a layer's parts all stored in one type, or
            # all dense
            raise ValueError(f"{', '.join(names)}: only some came as stored blocks, or mixed")
        module.quantized = dataclasses.replace(_concat(parts), bias=module.bias)
        module.weight = None  # the dense copy goes, unless shared (a tied lm_head's embedding)
        done += 1
    kinds = sorted(
        {
            t
            for m in model.modules()
            if isinstance(getattr(m, "quantized", None), BlockWeight)
            for t in m.quantized.types
        }
    )
    log.info(
        "%d of %d linear layers served as stored in the GGUF (%s; %s kernel)%s",
        done,
        done + len(left),
        ", ".join(kinds) or "none",
        int8_kernel(kernels),
        f"; at the model's dtype (not in Q8_0/Q4_0/Q4_1, or outputs not a multiple of 32): "
        f"{', '.join(left[:4])}{' ...' if len(left) > 4 else ''}"
        if left
        else "",
    )
    return done
