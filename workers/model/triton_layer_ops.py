"""The decoder layer's small ops as Triton kernels, for CUDA: the contract of the CPU kernels
(csrc/layer_ops_cpu.cpp) behind the same fused layer (`DecoderLayer.forward_fused`), so that a
layer is one launch per op instead of torch's eight for RMSNorm, twenty-two for rotary and two
for the KV write:

- `rms_norm`, `add_rms_norm` (`residual += x` in place, then the norm);
- `rotary_write_kv`: rotary on q and k in place, and k and v written into their paged slots,
  in one launch (the attention backend then skips its own write: `writes_kv`);
- `silu_and_mul`.

Rounding as the CPU kernels round, which is as the torch code they replace: math in fp32, the
normalized value rounded to the activations' dtype before the weight multiplies it, the
residual sum rounded, SiLU rounded before the multiply. Every launch takes its sizes from the
tensors' shapes and its data from the device: no host synchronisation, so a step of them can
be captured in a CUDA graph. Without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests check them.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from workers.model.attention.base import slot_index
from workers.model.triton_base import as_operand, jit, tl, triton, triton_unavailable

log = logging.getLogger(__name__)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@jit
def _rms_norm_kernel(
    x, res, w, out, x_stride, res_stride, out_stride, hidden, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # row * stride past 2**31 in a long prompt's step
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    h = tl.load(res + row * res_stride + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        delta = tl.load(x + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        h = as_operand(h + delta, DTYPE, True)
        tl.store(res + row * res_stride + cols, h.to(DTYPE), mask=ok)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    weight = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
    y = as_operand(weight * as_operand(h * inv, DTYPE, True), DTYPE, True)
    tl.store(out + row * out_stride + cols, y.to(DTYPE), mask=ok)


@jit
def _rotate(
    x, row, x_stride, cos_t, sin_t, heads,
    HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Rotate-half rotary on `heads` heads of one row of `x` ([T, heads, 2 * HALF], heads and
    head_dim contiguous), in place; returns the rotated halves (fp32, rounded to DTYPE)."""
    h = tl.arange(0, HEADS_P)[:, None]
    i = tl.arange(0, HALF_P)[None, :]
    ok = (h < heads) & (i < HALF)
    base = x + row * x_stride + h * (2 * HALF) + i
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    y1 = as_operand(x1 * cos_t - x2 * sin_t, DTYPE, True)
    y2 = as_operand(x2 * cos_t + x1 * sin_t, DTYPE, True)
    tl.store(base, y1.to(DTYPE), mask=ok)
    tl.store(base + HALF, y2.to(DTYPE), mask=ok)
    return y1, y2


@jit
def _rotary_kv_kernel(
    q, k, v, positions, cos, sin, slots, k_cache, v_cache,
    q_stride, k_stride, v_stride, c_block, c_slot, heads, kv_heads, block_size,
    HALF: tl.constexpr, HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr, WRITE: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + row)
    i = tl.arange(0, HALF_P)[None, :]
    cos_t = tl.load(cos + pos * HALF + i, mask=i < HALF, other=0.0)
    sin_t = tl.load(sin + pos * HALF + i, mask=i < HALF, other=0.0)
    _rotate(q, row, q_stride, cos_t, sin_t, heads, HALF, HEADS_P, HALF_P, DTYPE)
    k1, k2 = _rotate(k, row, k_stride, cos_t, sin_t, kv_heads, HALF, KV_HEADS_P, HALF_P, DTYPE)
    if WRITE:
        slot = tl.load(slots + row).to(tl.int64)  # a layer's cache may pass 2**31 elements
        if slot >= 0:  # a padded row (a captured batch's spare) writes nothing
            h = tl.arange(0, KV_HEADS_P)[:, None]
            ok = (h < kv_heads) & (i < HALF)
            at = (slot // block_size) * c_block + (slot % block_size) * c_slot + h * (2 * HALF) + i
            tl.store(k_cache + at, k1.to(DTYPE), mask=ok)
            tl.store(k_cache + at + HALF, k2.to(DTYPE), mask=ok)
            src = v + row * v_stride + h * (2 * HALF) + i
            tl.store(v_cache + at, tl.load(src, mask=ok, other=0.0), mask=ok)
            tl.store(v_cache + at + HALF, tl.load(src + HALF, mask=ok, other=0.0), mask=ok)


@jit
def _silu_mul_kernel(gate_up, out, width, in_stride, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(gate_up + row * in_stride + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * in_stride + width + cols, mask=ok, other=0.0).to(tl.float32)
    act = as_operand(g / (1.0 + tl.exp(-g)), DTYPE, True)
    tl.store(out + row * width + cols, as_operand(act * u, DTYPE, True).to(DTYPE), mask=ok)


def _dtype(t: torch.Tensor):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        t.dtype
    ]


class TritonLayerOps:
    """The fused layer's ops on Triton (the CPU kernels module's names and contracts, and
    `rotary_write_kv`). Build it with `triton_layer_ops()`."""

    writes_kv = True  # rotary_write_kv puts a step's K/V in the cache: the backend does not

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(x) * weight; x untouched. x: [T, hidden], rows contiguous."""
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(x, x, weight, out, eps, add=False)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place, rounded to its dtype); returns RMSNorm(residual) * weight."""
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(x, residual, weight, out, eps, add=True)
        return out

    def _norm(self, x, residual, weight, out, eps: float, add: bool) -> None:
        rows, hidden = residual.shape
        assert x.stride(1) == residual.stride(1) == 1, "rows must be contiguous"
        if rows:
            _rms_norm_kernel[(rows,)](
                x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
                hidden, float(eps), ADD=add, BLOCK=_pow2(hidden), DTYPE=_dtype(residual),
            )  # fmt: skip

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor | None = None,
        v_cache: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Rotary on q ([T, H, D]) and k ([T, KVH, D]) in place (heads and D contiguous, any
        row stride: the columns of the fused qkv output), from fp32 `cos`/`sin` tables
        [max_pos, D/2] at `positions`; then, with a cache, k and v written into their slots
        (`slots[t]`: block * block_size + offset; below 0: none) of the paged `k_cache`,
        `v_cache` ([blocks, block_size, KVH, D], each block dense, any block stride)."""
        rows, heads, dim = q.shape
        kv_heads = k.shape[1]
        assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and dim % 2 == 0
        assert q.stride(1) == k.stride(1) == v.stride(1) == dim, "heads must be contiguous"
        write = k_cache is not None
        if write:
            assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == dim
        if not rows:
            return
        cache_k = k_cache if write else k
        cache_v = v_cache if write else v
        _rotary_kv_kernel[(rows,)](
            q, k, v, positions, cos, sin, slots if write else positions, cache_k, cache_v,
            q.stride(0), k.stride(0), v.stride(0),
            k_cache.stride(0) if write else 0, k_cache.stride(1) if write else 0,
            heads, kv_heads, k_cache.shape[1] if write else 1,
            HALF=dim // 2, HEADS_P=_pow2(heads), KV_HEADS_P=_pow2(kv_heads),
            HALF_P=_pow2(dim // 2), WRITE=write, DTYPE=_dtype(q),
        )  # fmt: skip

    def rotary_inplace(self, qk, positions, cos, sin) -> None:
        """Rotary on one [T, heads, D] tensor in place (the CPU kernels' form)."""
        self.rotary_write_kv(qk, qk[:, :0], qk[:, :0], positions, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] (gate then up), rows contiguous. Returns silu(gate) * up, [T, I]."""
        rows, both = gate_up.shape
        width = both // 2
        out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            block = min(1024, _pow2(width))
            _silu_mul_kernel[(rows, triton.cdiv(width, block))](
                gate_up, out, width, gate_up.stride(0), BLOCK=block, DTYPE=_dtype(gate_up)
            )
        return out


class TorchLayerOps:
    """The same contract in torch ops: the reference the kernels are held to (at start, on the
    device, and in the tests)."""

    writes_kv = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (weight.float() * normed.float()).to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps: float) -> torch.Tensor:
        residual.copy_((residual.float() + x.float()).to(residual.dtype))
        return self.rms_norm(residual, weight, eps)

    def rotary_write_kv(self, q, k, v, positions, cos, sin, k_cache=None, v_cache=None, slots=None):
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        half = q.shape[-1] // 2
        for x in (q, k):
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            x1, x2 = (x1 * c - x2 * s).to(x.dtype), (x2 * c + x1 * s).to(x.dtype)
            x[..., :half], x[..., half:] = x1, x2
        if k_cache is not None:
            ok = slots >= 0
            index = slot_index(slots[ok], k_cache.shape[1])
            k_cache[index], v_cache[index] = k[ok], v[ok]

    def rotary_inplace(self, qk, positions, cos, sin) -> None:
        self.rotary_write_kv(qk, qk[:, :0], qk[:, :0], positions, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.silu(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype)


def triton_layer_ops() -> TritonLayerOps | None:
    """The ops, or None where Triton cannot run them (not installed; no CUDA device and no
    interpreter)."""
    if triton_unavailable() is not None:
        return None
    return TritonLayerOps()


def cuda_layer_ops(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> TritonLayerOps | None:
    """The kernels for a model of this shape on `device`, once they have passed their check;
    None (the layer stays on torch ops, and the log says why) otherwise."""
    ops = triton_layer_ops()
    why = triton_unavailable() if ops is None else None
    if ops is not None:
        why = layer_ops_refusal(ops, device, dtype, heads, kv_heads, head_dim)
    if why is not None:
        log.warning("the decoder layer's small ops run on torch, unfused: %s", why)
        return None
    return ops


def layer_ops_refusal(
    ops: TritonLayerOps, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
    head_dim: int,
) -> str | None:  # fmt: skip
    """Why the kernels cannot serve this model here (None: they can): each is launched once,
    at start, at the model's head shape and dtype, and held to the torch reference. A kernel
    that does not compile, or computes wrong, leaves the layer on torch ops (said at start,
    never found at the first step)."""
    torch_ops = TorchLayerOps()
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    try:
        x, res, w = rand(3, 96), rand(3, 96), rand(96)
        res2 = res.clone()
        got, want = ops.add_rms_norm(x, res, w, 1e-5), torch_ops.add_rms_norm(x, res2, w, 1e-5)
        checks = [("add_rms_norm", got, want), ("its residual", res, res2)]
        gu = rand(3, 200)
        checks.append(("silu_and_mul", ops.silu_and_mul(gu), torch_ops.silu_and_mul(gu)))
        width = (heads + 2 * kv_heads) * head_dim
        qkv = [rand(3, width) for _ in range(2)]
        qkv[1].copy_(qkv[0])
        cos, sin = rand(16, head_dim // 2).float(), rand(16, head_dim // 2).float()
        positions = torch.tensor([0, 7, 15], device=device)
        slots = torch.tensor([5, -1, 12], device=device)
        caches = [torch.zeros(4, 2, 4, kv_heads, head_dim, dtype=dtype, device=device)]
        caches.append(caches[0].clone())
        for impl, row, cache in zip((ops, torch_ops), qkv, caches):
            q, k, v = row.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
            impl.rotary_write_kv(
                q.view(3, heads, head_dim), k.view(3, kv_heads, head_dim),
                v.view(3, kv_heads, head_dim), positions, cos, sin, cache[:, 0], cache[:, 1],
                slots,
            )  # fmt: skip
        checks += [("rotary", qkv[0], qkv[1]), ("the KV write", caches[0], caches[1])]
    except Exception as e:  # no compiler, a driver too old, a shape the kernel refuses
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for name, got, want in checks:
        if not torch.allclose(got.float(), want.float(), **tol):
            return f"{name} differs from torch's by {(got.float() - want.float()).abs().max():.3g}"
    return None
