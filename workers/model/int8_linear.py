"""int8 linear weights (quantization: int8), for Tandem's int8 kernel
(csrc/linear_int8_cpu.cpp): each weight quantized at load per output channel, against
activations quantized as they arrive, a scale per group of 64 (or 32) inputs. Half bf16's bytes
per decode step."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from workers.model.cpu_kernels import cpu_kernels, switched_off
from workers.model.linear import PackedLinear, quantize_layers

log = logging.getLogger(__name__)

INT8_KERNEL_ENV = "TANDEM_INT8_KERNEL"  # "portable": the plain C++ path even where VNNI is built


@dataclass(frozen=True)
class Int8Weight:
    """A linear weight in int8 per output channel, packed for `linear_int8`: w ~ q * scale."""

    packed: torch.Tensor  # uint8 [N/32, K/4, 32, 4], q + 128
    scales: torch.Tensor  # fp32 [N]
    group: int  # activation inputs per scale (`int8_group`)
    portable: bool  # the plain C++ path, not AVX512-VNNI
    kernels: object  # the built CPU kernels (cpu_kernels.py)

    def matmul(self, rows: torch.Tensor, float_out: bool) -> torch.Tensor:
        return self.kernels.linear_int8(
            rows, self.packed, self.scales, self.group, float_out, self.portable
        )


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q [N, K] int8, scale [N] fp32), w ~ q * scale, the
    row's largest magnitude at +-127. An all-zero row (or one too small for a scale) gets
    scale 1, and q 0."""
    w = weight.detach().float()
    step = w.abs().amax(dim=1) / 127
    scale = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_group(inputs: int) -> int:
    """Inputs of an activation row that share one int8 scale: 64 where they divide the row,
    else 32. One scale for a whole row cost SmolLM2 3.7% perplexity (outlier channels in the
    MLP's activations); 64 inputs a scale cost 0.5%, no more than 32 did (6,000 tokens)."""
    return 64 if inputs % 64 == 0 else 32


def int8_kernel(kernels, vnni: bool | None = None) -> str:
    """Which int8 path `linear_int8` takes here: "avx512-vnni" or "portable". `vnni`: whether
    the build has the VNNI path, where `kernels` (the built module) is not at hand."""
    if vnni is None:
        vnni = kernels.linear_int8_vnni_supported()
    forced = os.environ.get(INT8_KERNEL_ENV, "") == "portable"
    return "avx512-vnni" if vnni and not forced else "portable"


def int8_unavailable(device: torch.device, quantization: str = "int8") -> str | None:
    """None when linears can be served by the int8 kernels (`quantization` int8 or gguf) on
    this device, else why not."""
    if device.type != "cpu":
        return (
            f"quantization={quantization!r} runs on the CPU only (device {device}); on CUDA, "
            "quantization='fp8' serves fp8 weights"
        )
    if cpu_kernels() is None:
        why = "TANDEM_CPU_KERNELS=0" if switched_off() else "they did not build (see the log)"
        return f"quantization={quantization!r} needs Tandem's CPU kernels: {why}"
    return None


def quantize_linears(model: nn.Module, device: torch.device) -> int:
    """Every PackedLinear of `model` that the int8 kernel takes (outputs and inputs multiples
    of 32, no bias), quantized per output channel and packed in place, one layer at a time
    (host memory holds one layer's fp32 copy on top of the model); returns how many. The rest
    stay for `pack_linears`. Raises ValueError where int8 cannot run (`int8_unavailable`)."""
    why_not = int8_unavailable(device)
    if why_not is not None:
        raise ValueError(why_not)
    kernels = cpu_kernels()
    portable = int8_kernel(kernels) == "portable"

    def quantize(m: PackedLinear) -> Int8Weight | None:
        if not m.fits_int8_kernel():
            return None
        q, scale = quantize_int8(m.weight)
        group = int8_group(q.shape[1])
        return Int8Weight(kernels.pack_linear_int8(q), scale, group, portable, kernels)

    what = f"int8 ({int8_kernel(kernels)} kernel)"
    return quantize_layers(model, quantize, what)
