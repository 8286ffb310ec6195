"""fp8 weights (quantization: fp8): per-channel e4m3 weights against per-row e4m3 activations
through torch._scaled_mm. It serves on CUDA GPUs of compute capability 8.9 or newer; torch's
CPU build has a reference _scaled_mm, so the arithmetic, the model-level quantization and the
refusals are checked here, on the CPU."""

from pathlib import Path

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.model.fp8_linear import (
    FP8_MAX,
    Fp8Weight,
    fp8_unavailable,
    quantize_fp8,
    quantize_linears_fp8,
)
from workers.model.linear import PackedLinear
from workers.model.loader import ModelSource, build_model


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Both sides rounded to e4m3 at their own scale (activation rows at absmax / 448, weight
    rows likewise), multiplied exactly, scaled back."""
    w = weight.float()
    ws = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    xs = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    wq = (w / ws).to(torch.float8_e4m3fn).double()
    xq = (x.float() / xs).to(torch.float8_e4m3fn).double()
    return (xq @ wq.t() * xs.double() * ws.double().t()).float()


def test_weights_quantize_per_output_channel():
    w = torch.randn(48, 64) * torch.tensor([1e-3, 1.0, 300.0] * 16)[:, None]
    w[5] = 0
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1, 48)
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 2]], torch.full((3,), FP8_MAX))
    assert scale[0, 5] == 1 and not q[5].float().any()  # a zero row: scale 1, values 0
    back = q.float() * scale.t()
    # e4m3: 3 mantissa bits, and a step of 2**-9 (of the row's scale) among its subnormals
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale.t() * 2**-10).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_match_the_rounded_reference_and_rows_stand_alone(dtype):
    torch.manual_seed(0)
    weight = torch.randn(96, 160) * torch.rand(96, 1) * 3
    x = (torch.randn(9, 160) * torch.rand(9, 1) * 5).to(dtype)
    q, scale = quantize_fp8(weight)
    fp8 = Fp8Weight(q, scale, None)
    got = fp8.matmul(x, True)
    want = reference(x, weight)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert fp8.matmul(x, False).dtype == dtype
    # A row's scale is its own, but _scaled_mm (oneDNN here, cuBLASLt on CUDA) may sum in an
    # order of the batch's shape: the caveat docs/operations.md gives for cuBLAS.
    for i in (0, 4, 8):
        alone = fp8.matmul(x[i : i + 1], True)
        assert torch.allclose(alone, got[i : i + 1], rtol=1e-5, atol=1e-5 * got.abs().max().item())
    exact = x.float() @ weight.t()
    assert (got - exact).norm() / exact.norm() < 0.06


def test_a_model_quantizes_what_fits_and_serves_it(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")  # plain linears, as on CUDA
    model = build_model(ModelSource(tiny_llama_dir), torch.float32, torch.device("cpu"))
    x = torch.randn(3, 64)
    before = model.layers[0].gate_up_proj(x)
    head_before = model.lm_head(x, float_out=True)
    assert quantize_linears_fp8(model) == 13  # 3 layers x 4, and the tied lm_head
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(isinstance(m.quantized, Fp8Weight) and m.weight is None for m in linears)
    assert model.embed_tokens.weight is not None  # looked up at full width
    after = model.layers[0].gate_up_proj(x)
    assert (after - before).norm() / before.norm() < 0.06
    head = model.lm_head(x, float_out=True)
    assert head.dtype == torch.float32 and (head - head_before).norm() / head_before.norm() < 0.06


def test_fp8_is_refused_where_it_cannot_run(tiny_llama_dir):
    with pytest.raises(ValueError, match="compute capability 8.9"):
        EngineConfig(quantization="fp8", device="cpu")
    with pytest.raises(ValueError, match="compute capability 8.9"):  # auto, with no GPU
        EngineConfig(quantization="fp8").resolve(cuda=False)
    EngineConfig(quantization="fp8", device="cuda")  # taken, for a GPU to judge
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="int8", device="cuda:1")
    assert "int8" in fp8_unavailable(torch.device("cpu"))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        build_model(
            ModelSource(tiny_llama_dir), torch.float32, torch.device("cpu"), quantization="fp8"
        )


# -- FP8 checkpoints: read as their real values, and quantized back to themselves ---------------
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_checkpoint(src, dest, method: str, block: int | None = None):
    """The tiny model's folder as an FP8 checkpoint of `method`: each linear weight in e4m3,
    scaled per output channel (compressed-tensors) or per block (transformers' fp8, which keeps
    the scale's inverse name), with a static activation scale beside it as such files have.
    Returns {weight name: the values the checkpoint holds, dequantized}."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    tensors, held = load_file(str(src / "model.safetensors")), {}
    out = {}
    for name, w in tensors.items():
        if not any(f".{p}." in name for p in _LINEARS):
            out[name] = w
            continue
        w = w.float()
        if block is None:
            q, scale = quantize_fp8(w)
            out[name + "_scale"] = scale.t().contiguous()  # [N, 1]
            held[name] = q.float() * scale.t()
        else:
            n, k = w.shape
            tiles = w.reshape(n // block, block, k // block, block)
            scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX  # [N / b, K / b]
            full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
            q = (w / full).to(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = scale
            held[name] = q.float() * full
        out[name] = q
        out[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
    save_file(out, str(dest / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if method == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    else:
        group = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
        cfg["quantization_config"] = {
            "quant_method": method,
            "format": "float-quantized",
            "config_groups": {"group_0": group},
        }
    (dest / "config.json").write_text(json.dumps(cfg))
    return held


@pytest.mark.parametrize("method,block", [("compressed-tensors", None), ("fp8", 32)])
def test_fp8_checkpoints_load_as_their_real_values(tiny_llama_dir, tmp_path, method, block):
    from workers.model.loader import read_checkpoint

    held = fp8_checkpoint(Path(tiny_llama_dir), tmp_path / "fp8", method, block)
    _, tensors = read_checkpoint(ModelSource(tmp_path / "fp8"))
    assert not any(n.endswith(("_scale", "_scale_inv", "input_scale")) for n in tensors)
    for name, values in held.items():
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], values), name


def test_fp8_weights_quantize_back_to_the_checkpoint(tiny_llama_dir, tmp_path, monkeypatch):
    """Per-channel scales at the row's largest magnitude: quantization fp8 of the loaded bf16
    model gives back the checkpoint's own e4m3 values, q, k and v fused."""
    from safetensors.torch import load_file

    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    fp8_checkpoint(Path(tiny_llama_dir), tmp_path / "fp8", "compressed-tensors")
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    model = build_model(ModelSource(tmp_path / "fp8"), torch.bfloat16, torch.device("cpu"))
    quantize_linears_fp8(model)
    p = "model.layers.1."
    want = torch.cat([stored[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
    got = model.layers[1].qkv_proj.quantized.q
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(
        model.layers[1].down_proj.quantized.q.view(torch.uint8),
        stored[f"{p}mlp.down_proj.weight"].view(torch.uint8),
    )


def test_checkpoints_tandem_cannot_read_are_refused_by_name(tiny_llama_dir, tmp_path):
    import json
    import shutil

    from workers.model.config import CheckpointError
    from workers.model.loader import read_checkpoint

    gptq = tmp_path / "gptq"
    shutil.copytree(tiny_llama_dir, gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        read_checkpoint(ModelSource(gptq))
    # fp8 weights with no quantization_config to say where their scales are
    bare = tmp_path / "bare"
    fp8_checkpoint(Path(tiny_llama_dir), bare, "compressed-tensors")
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["quantization_config"]
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no scale beside it"):
        read_checkpoint(ModelSource(bare))
