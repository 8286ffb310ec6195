"""fp8 linear weights on CUDA (quantization: fp8, compute capability 8.9 or newer): each
weight quantized at load to e4m3 per output channel, multiplied by `torch._scaled_mm` against
activations quantized per row as they arrive. Half bf16's bytes per decode step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from workers.model.linear import PackedLinear, quantize_layers

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # e4m3's largest finite value


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight in fp8 e4m3 per output channel, for `torch._scaled_mm`: w ~ q * scale.
    Each activation row is quantized as it arrives, at its own absmax / 448, so a row's result
    depends on that row alone."""

    q: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [1, N]
    bias: torch.Tensor | None

    def matmul(self, rows: torch.Tensor, float_out: bool) -> torch.Tensor:
        x = rows.float()
        step = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
        xq = (x / step).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_dtype = torch.float32 if float_out else rows.dtype
        # CUDA's row-wise scaled GEMMs write bf16 (fp32 only through cuBLAS on sm90)
        native = torch.bfloat16 if rows.is_cuda else out_dtype
        out = torch._scaled_mm(xq, self.q.t(), scale_a=step, scale_b=self.scale, out_dtype=native)
        if self.bias is not None:
            out = out + self.bias.to(native)
        return out if native == out_dtype else out.to(out_dtype)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 per output channel: (q [N, K] float8_e4m3fn, scale [1, N] fp32), w ~ q * scale,
    the row's largest magnitude at 448. An all-zero row gets scale 1."""
    w = weight.detach().float()
    step = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(step > 0, step, torch.ones_like(step))
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale[None, :].contiguous()


def fp8_unavailable(device: torch.device) -> str | None:
    """None when linears can be served in fp8 on this device, else why not."""
    if device.type != "cuda":
        return (
            f"quantization='fp8' runs on CUDA GPUs of compute capability 8.9 or newer (device "
            f"{device}); on the CPU, quantization='int8' serves int8 weights"
        )
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return (
            "quantization='fp8' needs torch._scaled_mm and float8_e4m3fn "
            f"(torch {torch.__version__})"
        )
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        return (
            f"quantization='fp8' needs fp8 tensor cores (compute capability 8.9 or newer: Ada, "
            f"Hopper, Blackwell); {name} is {major}.{minor} (quantization='none')"
        )
    # Row-wise scaled GEMMs came to each architecture in its own torch release: one small
    # product says whether this torch has them for this GPU, before a model is quantized.
    try:
        ones = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        scale = torch.ones(16, 1, device=device)
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return (
            f"quantization='fp8': torch {torch.__version__} has no row-wise fp8 GEMM for {name} "
            f"({major}.{minor}): {str(e).splitlines()[0]}"
        )
    return None


def quantize_linears_fp8(model: nn.Module) -> int:
    """Every linear layer of `model` whose outputs and inputs are multiples of 16 (what fp8
    GEMMs take), quantized to fp8 per output channel in place, one layer at a time; returns
    how many. The rest keep the model's dtype. The caller checks the device
    (`fp8_unavailable`)."""

    def quantize(m: PackedLinear) -> Fp8Weight | None:
        n, k = m.weight.shape
        if n % 16 or k % 16:
            return None
        return Fp8Weight(*quantize_fp8(m.weight), m.bias)

    return quantize_layers(model, quantize, "fp8 e4m3 per output channel")
