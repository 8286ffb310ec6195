"""int8 linear layers (quantization: int8, and GGUF's Q8_0/Q4_0/Q4_1 blocks as stored): the
kernel's products against an exact reference, its AVX512-VNNI and portable paths bit for bit,
rows independent of their batch, and the model-level quantization that packs what fits and
leaves the rest."""

import logging

import pytest
import torch
import torch.nn.functional as F

from workers.engine.config import EngineConfig
from workers.model.cpu_kernels import cpu_kernels
from workers.model.int8_linear import (
    INT8_KERNEL_ENV,
    int8_group,
    int8_kernel,
    int8_unavailable,
    quantize_int8,
    quantize_linears,
)
from workers.model.linear import PackedLinear

CPU = torch.device("cpu")
KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="Tandem's CPU kernels did not build")
PATHS = [True, False] if KERNELS is not None and KERNELS.linear_int8_vnni_supported() else [True]


def quantized_rows(x: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations, written out in torch: each row quantized to int8 in groups of
    `g` inputs, each at its own absmax / 127 (round half to even). Returns (values [m,
    groups, g], each group's scale [m, groups])."""
    m, k = x.shape
    xf = x.float().view(m, k // g, g)
    absmax = xf.abs().amax(dim=2)  # [m, groups]
    step = torch.full_like(absmax, 127.0) / absmax  # a true division, as the kernel's
    zero = ~torch.isfinite(step)  # an all-zero group, or one too small for a finite step
    absmax = torch.where(zero, torch.zeros_like(absmax), absmax)
    xq = torch.round(xf * step[..., None]).clamp(-127, 127)
    xq = torch.where(zero[..., None], torch.zeros_like(xq), xq)
    return xq, absmax / 127


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c with one rounding (through fp64: every product of these fp32 values is
    exact there)."""
    return (a.double() * b.double() + c.double()).float()


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 per output channel: each group's integer products summed exactly, then folded
    into fp32 in order with one fused multiply-add by the group's scale; the weight's scale
    multiplies last."""
    k = x.shape[1]
    g = int8_group(k)
    xq, group_scale = quantized_rows(x, g)
    qg = q.double().view(q.shape[0], k // g, g)
    sums = torch.einsum("mgk,ngk->mgn", xq.double(), qg).float()  # exact integers
    acc = torch.zeros(x.shape[0], q.shape[0])
    for i in range(k // g):
        acc = fma(sums[:, i], group_scale[:, i, None], acc)
    return acc * scale[None, :]


def block_reference(x, q, d, m=None) -> torch.Tensor:
    """A GGUF block weight (w = d q for Q8_0 and for Q4_0's q - 8, d q + m for Q4_1, per
    output and 32 inputs): activations in groups of 32; per group, t = sum * d or
    fma(sum, d, m * sum(x_q)), then acc = fma(t, s_x, acc)."""
    k = x.shape[1]
    xq, group_scale = quantized_rows(x, 32)
    qg = q.double().view(q.shape[0], k // 32, 32)
    sums = torch.einsum("mgk,ngk->mgn", xq.double(), qg).float()  # exact integers
    xsum = xq.sum(dim=2)  # [m, groups], exact
    acc = torch.zeros(x.shape[0], q.shape[0])
    for i in range(k // 32):
        dg = d[:, i].float()[None, :]
        if m is None:
            t = sums[:, i] * dg
        else:
            t = fma(sums[:, i], dg, m[:, i].float()[None, :] * xsum[:, i, None])
        acc = fma(t, group_scale[:, i, None], acc)
    return acc


def block_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, K/32] into the kernel's [N/32, K/32, 32]."""
    return s.view(s.shape[0] // 32, 32, -1).transpose(1, 2).contiguous()


def packed(weight: torch.Tensor):
    q, scale = quantize_int8(weight)
    return q, scale, KERNELS.pack_linear_int8(q), int8_group(q.shape[1])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 96), (160, 576), (576, 1536)])
def test_products_equal_the_exact_reference_on_every_path(n, k, dtype):
    torch.manual_seed(n + k)
    weight = torch.randn(n, k) * torch.rand(n, 1) * 3  # a spread of channel scales
    q, scale, w, group = packed(weight)
    x = (torch.randn(257, k) * torch.rand(257, 1) * 4).to(dtype)
    want = reference(x, q, scale)
    for portable in PATHS:
        got = KERNELS.linear_int8(x, w, scale, group, True, portable)
        assert got.dtype == torch.float32 and got.shape == (257, n)
        assert torch.equal(got, want), (portable, (got - want).abs().max())
        rounded = KERNELS.linear_int8(x, w, scale, group, False, portable)
        assert rounded.dtype == dtype and torch.equal(rounded, want.to(dtype))
    # and int8 is near the float product: about 1% of its norm at these sizes
    exact = x.float() @ weight.t()
    assert (want - exact).norm() / exact.norm() < 0.03


@needs_kernels
@pytest.mark.parametrize("portable", PATHS)
def test_rows_do_not_depend_on_the_batch_or_threads(portable):
    torch.manual_seed(1)
    _, scale, w, group = packed(torch.randn(960, 576))
    x = torch.randn(300, 576).to(torch.bfloat16)
    full = KERNELS.linear_int8(x, w, scale, group, False, portable)
    for rows in (1, 5, 6, 7, 8, 9, 13, 257):  # tiles of 6 (VNNI) or 8 rows, blocks of 256
        assert torch.equal(
            KERNELS.linear_int8(x[:rows], w, scale, group, False, portable), full[:rows]
        )
    assert torch.equal(KERNELS.linear_int8(x[5:6], w, scale, group, False, portable), full[5:6])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(KERNELS.linear_int8(x, w, scale, group, False, portable), full)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("portable", PATHS)
def test_zero_tiny_and_non_finite_groups(portable):
    q, scale, w, group = packed(torch.randn(64, 192))  # three groups of 64 a row
    x = torch.randn(5, 192)
    x[0] = 0
    x[1, 70] = float("inf")  # in the second group
    x[2, 130] = float("nan")  # in the third
    x[3, 64:128] = 0  # a zero group in a row that is not
    x[4, :64] = 1e-38  # a group too small for a finite step: taken as zero
    out = KERNELS.linear_int8(x, w, scale, group, True, portable)
    assert torch.equal(out[0], torch.zeros(64))  # a zero row has no scale to find, and is 0
    assert out[1:3].isnan().all()  # a non-finite input is not quantized into a finite output
    assert torch.equal(out[3:], reference(x[3:], q, scale))
    assert torch.equal(out[4], reference(x[4:5, 64:].contiguous(), q[:, 64:], scale)[0])


@needs_kernels
def test_bad_arguments_are_refused_with_the_reason():
    q, scale, w, group = packed(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match="multiples of 32"):
        KERNELS.pack_linear_int8(torch.zeros(40, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="multiples of 32"):
        KERNELS.pack_linear_int8(torch.zeros(64, 40, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="64 inputs"):
        KERNELS.linear_int8(torch.randn(2, 64), w[:, :8].contiguous(), scale, group, False, True)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        KERNELS.linear_int8(torch.randn(2, 64).half(), w, scale, group, False, True)
    with pytest.raises(RuntimeError, match="scales must be"):
        KERNELS.linear_int8(torch.randn(2, 64), w, scale[:32], group, False, True)
    with pytest.raises(RuntimeError, match="must be 32 or 64"):
        KERNELS.linear_int8(torch.randn(2, 64), w, scale, 48, False, True)
    with pytest.raises(RuntimeError, match="does not match"):
        KERNELS.linear_int8(torch.randn(2, 64), w.view(1, 16, 64, 4), scale, group, False, True)


def gguf_block_weight(n: int, k: int, kind: str):
    """A random block weight as GGUF stores one: (values as the reference multiplies them,
    d, m, packed); m None but for Q4_1. Scales reach fp16's subnormals, and Q8_0's values its
    -128."""
    d = (torch.rand(n, k // 32) * 0.02).half()
    d[0, 0] = 3e-6  # an fp16 subnormal
    if kind == "Q8_0":
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        return q, d, None, KERNELS.pack_linear_int8(q)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    if kind == "Q4_0":
        return q.to(torch.int16) - 8, d, None, KERNELS.pack_linear_int4(q)
    m = (torch.randn(n, k // 32) * 0.1).half()
    return q, d, m, KERNELS.pack_linear_int4(q)


BLOCK_KINDS = ["Q8_0", "Q4_0", "Q4_1"]


def run_blocks(x, d, m, packed, float_out=True, portable=True, four_bit=None):
    scales_m = block_scales(m) if m is not None else torch.empty(0, dtype=torch.half)
    if four_bit is None:
        four_bit = packed.shape[1] * 8 == x.shape[1]
    return KERNELS.linear_blocks(
        x, packed, block_scales(d), scales_m, four_bit, float_out, portable
    )


@needs_kernels
@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 160), (576, 1536)])
def test_gguf_blocks_equal_the_exact_reference_on_every_path(n, k, dtype, kind):
    torch.manual_seed(n + k)
    q, d, m, w = gguf_block_weight(n, k, kind)
    x = (torch.randn(67, k) * torch.rand(67, 1) * 4).to(dtype)
    x[3, 32:64] = 0  # a zero group
    want = block_reference(x, q, d, m)
    for portable in PATHS:
        got = run_blocks(x, d, m, w, True, portable)
        assert got.shape == (67, n) and torch.equal(got, want), (portable, (got - want).abs().max())
        rounded = run_blocks(x, d, m, w, False, portable)
        assert rounded.dtype == dtype and torch.equal(rounded, want.to(dtype))
    dense = d.float().repeat_interleave(32, 1) * q.float()
    if m is not None:
        dense += m.float().repeat_interleave(32, 1)
    exact = x.float() @ dense.t()
    assert (want - exact).norm() / exact.norm() < 0.03  # activations' rounding alone


@needs_kernels
@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("portable", PATHS)
def test_gguf_block_rows_do_not_depend_on_the_batch(portable, kind):
    torch.manual_seed(2)
    _, d, m, w = gguf_block_weight(192, 576, kind)
    x = torch.randn(40, 576).to(torch.bfloat16)
    full = run_blocks(x, d, m, w, False, portable)
    for rows in (1, 5, 6, 7, 13):
        assert torch.equal(run_blocks(x[:rows], d, m, w, False, portable), full[:rows])
    assert torch.equal(run_blocks(x[9:10], d, m, w, False, portable), full[9:10])


@needs_kernels
def test_gguf_block_arguments_are_checked():
    q, d, m, w = gguf_block_weight(64, 64, "Q4_1")
    with pytest.raises(RuntimeError, match="0..15"):
        KERNELS.pack_linear_int4(torch.full((32, 32), 16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="multiples of 32"):
        KERNELS.pack_linear_int4(torch.zeros(32, 48, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="m must be shaped as d, or empty"):
        run_blocks(torch.randn(2, 64), d, m[:32], w)
    with pytest.raises(RuntimeError, match="d must be"):
        run_blocks(torch.randn(2, 64), d[:, :1].contiguous(), m, w)
    q8, d8, _, w8 = gguf_block_weight(64, 64, "Q8_0")
    with pytest.raises(RuntimeError, match="Q8_0 takes no minimum"):
        KERNELS.linear_blocks(
            torch.randn(2, 64), w8, block_scales(d8), block_scales(d8), False, False, True
        )
    with pytest.raises(RuntimeError, match="does not match"):  # a 4-bit weight read as Q8_0
        run_blocks(torch.randn(2, 64), d, None, w, four_bit=False)


def test_weight_quantization_per_output_channel():
    weight = torch.randn(6, 40) * torch.tensor([[1e-3], [1.0], [50.0], [0.0], [7.0], [1e-44]])
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.abs().max() <= 127
    for row in (3, 5):  # a zero row, and one too small for a scale
        assert torch.equal(q[row], torch.zeros(40, dtype=torch.int8)) and scale[row] == 1
    for row in (0, 1, 2, 4):
        assert q[row].abs().max() == 127  # each channel uses its whole range
        err = (q[row].float() * scale[row] - weight[row]).abs().max()
        assert err <= scale[row] / 2 * (1 + 1e-5)


@needs_kernels
def test_quantize_linears_packs_what_fits_and_leaves_the_rest(caplog):
    torch.manual_seed(2)
    fits = PackedLinear(96, 160, bias=False).to(torch.bfloat16)  # groups of 32 inputs
    odd = PackedLinear(96, 100, bias=False).to(torch.bfloat16)  # 100 outputs: no 32-blocks
    embed = torch.nn.Embedding(64, 96).to(torch.bfloat16)
    head = PackedLinear(96, 64, bias=False)
    head.weight = embed.weight  # a tied lm_head
    model = torch.nn.ModuleDict({"fits": fits, "odd": odd, "embed": embed, "head": head})
    dense = fits.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="workers.model"):
        assert quantize_linears(model, CPU) == 2
    assert "2 of 3 linear layers quantized to int8" in caplog.text
    assert fits.quantized is not None and fits.weight is None
    assert odd.quantized is None and odd.weight is not None  # left for pack_linears
    assert head.quantized is not None and embed.weight is not None  # the embedding stays
    q, scale = quantize_int8(dense)
    x = torch.randn(3, 2, 96).to(torch.bfloat16)  # leading dimensions, as F.linear takes
    want = reference(x.view(6, 96), q, scale).to(torch.bfloat16).view(3, 2, 160)
    assert torch.equal(fits(x), want)
    assert fits(x, float_out=True).dtype == torch.float32
    wide = torch.randn(4, 192).to(torch.bfloat16)
    assert torch.equal(fits(wide[:, ::2]), fits(wide[:, ::2].contiguous()))
    assert fits(x[:0].view(0, 96)).shape == (0, 160)
    assert torch.allclose(fits(x).float(), F.linear(x, dense).float(), rtol=0.1, atol=0.1)


@needs_kernels
def test_the_portable_path_is_chosen_by_the_cpu_or_forced(monkeypatch):
    monkeypatch.setenv(INT8_KERNEL_ENV, "portable")
    assert int8_kernel(KERNELS) == "portable"
    layer = PackedLinear(64, 64, bias=False)
    quantize_linears(layer, CPU)
    assert layer.quantized.portable and layer.quantized.group == 64


def test_int8_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="CPU only"):  # auto, where a GPU is at hand
        EngineConfig(quantization="int8").resolve(cuda=True, bf16=True)
    with pytest.raises(ValueError, match="choose from none, int8"):
        EngineConfig(quantization="fp4")
    assert "CPU only" in int8_unavailable(torch.device("meta"))
    if KERNELS is None:
        assert "CPU kernels" in int8_unavailable(CPU)
    monkeypatch.setattr("workers.model.int8_linear.cpu_kernels", lambda: None)
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNELS=0"):
        quantize_linears(PackedLinear(32, 64, bias=False), CPU)


def test_benchmarks_run_each_tandem_system_once_per_quantization():
    from benchmarks.common import quantizations, quantized_runs, unquantized_label

    full = {"quantization": "none", "kv_cache_dtype": "auto"}
    runs = quantized_runs(["tandem", "tandem-unpacked", "vllm"], "none,int8,int8", "auto,fp8")
    assert runs == [
        ("tandem", "tandem", full),
        ("tandem-fp8kv", "tandem", {**full, "kv_cache_dtype": "fp8"}),
        ("tandem-int8", "tandem", {**full, "quantization": "int8"}),
        ("tandem-int8-fp8kv", "tandem", {"quantization": "int8", "kv_cache_dtype": "fp8"}),
        ("tandem-unpacked", "tandem-unpacked", full),  # no CPU kernels: no int8
        ("vllm", "vllm", full),
    ]
    assert unquantized_label("tandem-int8", runs) == "tandem"
    assert unquantized_label("tandem-int8-fp8kv", runs) == "tandem"
    assert unquantized_label("tandem", runs) is None
    only_int8 = quantized_runs(["tandem"], "int8")
    assert unquantized_label("tandem-int8", only_int8) is None  # nothing to compare with
    with pytest.raises(ValueError, match="choose from none, int8"):
        quantizations("int4")
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4': choose from auto, fp8"):
        quantized_runs(["tandem"], "none", "int4")
