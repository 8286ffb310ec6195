"""Linear weights prepacked for oneDNN or the bf16 kernel: the same products as F.linear, the
dense copy gone, a tied lm_head's embedding kept, and a clear fallback when packing is off."""

import logging

import pytest
import torch
import torch.nn.functional as F

from workers.model.cpu_kernels import cpu_kernels
from workers.model.linear import PackedLinear, pack_linears, packing_available

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    packing_available(CPU) is not None, reason=f"no packing here: {packing_available(CPU)}"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_dense(dtype, bias):
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 on this CPU")
    torch.manual_seed(0)
    layer = PackedLinear(96, 160, bias=bias).to(dtype)
    weight = layer.weight.detach().clone()
    b = layer.bias.detach().clone() if bias else None
    assert pack_linears(layer, CPU) == 1
    assert layer.weight is None and layer.packed is not None
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for rows in (1, 3, 16, 300):  # decode batches and a prefill chunk, one packing for all
        x = torch.randn(rows, 96).to(dtype)
        got = layer(x).float()
        want = F.linear(x, weight, b).float()
        assert got.shape == (rows, 160)
        assert torch.allclose(got, want, rtol=tol, atol=tol), (rows, (got - want).abs().max())
        logits = layer(x, float_out=True)  # fp32: the kernel's sums, or oneDNN's cast
        assert logits.dtype == torch.float32
        rounded = logits.to(dtype).float() if layer.kernels else logits
        assert torch.equal(rounded, layer(x).float())
    # A non-contiguous input (a slice of a wider row) is handled, not misread.
    wide = torch.randn(5, 192).to(dtype)
    assert torch.allclose(
        layer(wide[:, ::2]).float(), F.linear(wide[:, ::2], weight, b).float(), rtol=tol, atol=tol
    )


def _bf16_kernel_missing() -> str | None:
    if packing_available(CPU) is not None:
        return packing_available(CPU)
    kernels = cpu_kernels()
    if kernels is None or not kernels.linear_bf16_supported():
        return "no AVX512-BF16 kernel on this CPU"
    return None


@pytest.mark.skipif(_bf16_kernel_missing() is not None, reason=str(_bf16_kernel_missing()))
def test_bf16_kernel_rows_do_not_depend_on_the_batch_or_threads():
    torch.manual_seed(0)
    layer = PackedLinear(576, 960, bias=False).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    assert pack_linears(layer, CPU) == 1
    assert layer.kernels is not None and layer.weight is None
    x = torch.randn(300, 576).to(torch.bfloat16)
    full = layer(x)
    want = x.float() @ weight.float().t()
    assert torch.allclose(full.float(), want, rtol=1e-2, atol=2e-2), (
        (full.float() - want).abs().max()
    )
    # A sequence's row is the same bits alone, in any batch (tiles of 8 rows, 256-row
    # blocks), and on one thread or two: the cluster's outputs equal the offline engine's.
    for rows in (1, 7, 8, 9, 257):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    assert torch.equal(layer(x[5:6]), full[5:6])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)
    # Logits come out in fp32, unrounded: the same sums the bf16 result rounds once.
    sums = layer(x, float_out=True)
    assert sums.dtype == torch.float32 and torch.equal(sums.to(torch.bfloat16), full)
    # Leading dimensions, strided rows and no rows at all are taken as F.linear takes them.
    assert layer(x[:0]).shape == (0, 960)
    assert torch.equal(layer(x[:6].view(2, 3, 576)), full[:6].view(2, 3, 960))
    wide = torch.randn(4, 1152).to(torch.bfloat16)
    assert torch.equal(layer(wide[:, ::2]), layer(wide[:, ::2].contiguous()))


def test_bf16_kernel_is_not_used_where_it_does_not_fit():
    assert (
        not PackedLinear(96, 100, bias=False).to(torch.bfloat16).fits_bf16_kernel()
    )  # 100 outputs
    assert not PackedLinear(96, 160, bias=True).to(torch.bfloat16).fits_bf16_kernel()
    assert not PackedLinear(96, 160, bias=False).fits_bf16_kernel()  # fp32
    assert PackedLinear(96, 160, bias=False).to(torch.bfloat16).fits_bf16_kernel()


@needs_onednn
def test_tied_head_keeps_the_embedding():
    embed = torch.nn.Embedding(50, 32)
    head = PackedLinear(32, 50, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    assert pack_linears(model, CPU) == 1
    assert head.weight is None and embed.weight is not None
    x = torch.randn(2, 32)
    assert torch.allclose(head(x), x @ embed.weight.t(), atol=1e-5)
    assert pack_linears(model, CPU) == 0  # packing twice is a no-op


def test_switched_off_keeps_dense_weights_and_says_why(monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    layer = PackedLinear(8, 4)
    with caplog.at_level(logging.WARNING, logger="workers.model.linear"):
        assert pack_linears(layer, CPU) == 0
    assert layer.packed is None and layer.weight is not None
    assert "TANDEM_CPU_KERNELS=0" in caplog.text
    x = torch.randn(2, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_other_devices_are_not_packed():
    assert "CPU only" in packing_available(torch.device("meta"))
