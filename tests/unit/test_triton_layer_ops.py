"""The decoder layer's Triton ops for CUDA (workers/model/triton_layer_ops.py): each kernel
against the torch reference, in Triton's interpreter on the CPU (bf16 and fp32, odd sizes,
slots across block boundaries); the reference against the model's own torch ops; the model on
the fused ops that write the KV with the rotary against the model on torch ops; and how many
kernels a decoder layer launches on them.

The interpreter runs in a subprocess, as in test_triton_decode.py: TRITON_INTERPRET must be
set before triton is imported.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit import triton_checks
from workers.model.attention.base import AttentionMetadata
from workers.model.llama import DecoderLayer, RMSNorm
from workers.model.rope import RotaryEmbedding
from workers.model.triton_layer_ops import TorchLayerOps

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2**-7)}  # a bf16 rounding apart


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol, rtol = TOL[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True, msg=what)


def check_norms() -> None:
    from workers.model.triton_layer_ops import TritonLayerOps

    ops, ref = TritonLayerOps(), TorchLayerOps()
    for dtype in TOL:
        for rows, hidden in ((1, 576), (5, 100), (3, 1024), (2, 1)):
            g = torch.Generator().manual_seed(rows * hidden)
            x = torch.randn(rows, 2 * hidden, generator=g).to(dtype)[:, :hidden]  # row stride
            res = torch.randn(rows, hidden, generator=g).to(dtype)
            w = torch.randn(hidden, generator=g).to(dtype)
            close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), f"rms_norm {hidden}")
            res2 = res.clone()
            got, want = ops.add_rms_norm(x, res, w, 1e-6), ref.add_rms_norm(x, res2, w, 1e-6)
            close(got, want, f"add_rms_norm {dtype} {rows}x{hidden}")
            assert torch.equal(res, res2), f"{dtype} {hidden}: residual += x rounded otherwise"


def check_rotary_kv() -> None:
    from workers.model.triton_layer_ops import TritonLayerOps

    ops, ref = TritonLayerOps(), TorchLayerOps()
    for dtype in TOL:
        for heads, kv_heads, dim, block_size in ((9, 3, 64, 16), (4, 1, 80, 4), (2, 2, 128, 1)):
            g = torch.Generator().manual_seed(heads * dim)
            rows, width = 7, (heads + 2 * kv_heads) * dim
            qkv = torch.randn(rows, width + 8, generator=g).to(dtype)[:, :width]  # row stride
            cos, sin = torch.rand(40, dim // 2, generator=g), torch.rand(40, dim // 2, generator=g)
            positions = torch.tensor([0, 39, 3, 17, 17, 8, 1])
            # Slots across block boundaries, one row padded (-1: written nowhere).
            slots = torch.tensor([0, block_size - 1, block_size, 3 * block_size + 1, -1, 21, 9])
            nan = float("nan")
            cache = torch.full((24, 2, block_size, kv_heads, dim), nan, dtype=dtype)
            got = (qkv.clone(), cache.clone())
            want = (qkv.clone(), cache.clone())
            for impl, (rows_, layer) in ((ops, got), (ref, want)):
                q, k, v = rows_.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
                impl.rotary_write_kv(
                    q.view(rows, heads, dim), k.view(rows, kv_heads, dim),
                    v.view(rows, kv_heads, dim), positions, cos, sin, layer[:, 0], layer[:, 1],
                    slots,
                )  # fmt: skip
            what = f"{dtype} H={heads} KVH={kv_heads} D={dim} block {block_size}"
            close(got[0], want[0], f"q, k rotated; v untouched: {what}")
            close(got[1], want[1], f"the cache, untouched slots NaN: {what}")
            assert torch.equal(got[0][:, -kv_heads * dim :], qkv[:, -kv_heads * dim :]), what


def check_silu() -> None:
    from workers.model.triton_layer_ops import TritonLayerOps

    ops, ref = TritonLayerOps(), TorchLayerOps()
    for dtype in TOL:
        for rows, width in ((3, 1536), (2, 100), (1, 1500), (4, 2048)):
            g = torch.Generator().manual_seed(width)
            gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
            close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), f"silu {dtype} {width}")


CHECKS = {"norms": check_norms, "rotary_kv": check_rotary_kv, "silu": check_silu}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return triton_checks.interpreted("tests.unit.test_triton_layer_ops")


@pytest.mark.parametrize("check", CHECKS)
def test_interpreted(interpreted: dict[str, str], check: str) -> None:
    assert interpreted[check] == "ok", interpreted[check]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_the_models_own_torch_ops(dtype):
    """What the kernels are held to is what the unfused layer computes, bit for bit."""
    torch.manual_seed(0)
    ref = TorchLayerOps()
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data = torch.randn(64).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    assert torch.equal(ref.rms_norm(x, norm.weight, norm.eps), norm(x))
    rope = RotaryEmbedding(64, 128, 10000.0, None)
    positions = torch.tensor([0, 5, 127, 9, 64])
    q, k = torch.randn(5, 4, 64).to(dtype), torch.randn(5, 2, 64).to(dtype)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    ref.rotary_write_kv(q, k, k, positions, rope.cos, rope.sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    gate_up = torch.randn(5, 96).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ref.silu_and_mul(gate_up), F.silu(gate) * up)


def test_the_model_on_ops_that_write_the_kv_equals_the_model_on_torch_ops(tiny_llama_dir):
    """The fused layer with `writes_kv` (the CUDA form: rotary and KV write in one op, the
    backend writing nothing) against the plain torch layer, on the same engine: logits and
    greedy outputs."""
    from tests.reference import engine_logits, run_engine
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=4))
    model = engine.runner.model
    prompts = [[1, 504, 3575, 282, 4649, 314], list(range(100, 160))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    model.use_fused_ops(TorchLayerOps())
    fused = [engine_logits(engine, p) for p in prompts], run_engine(engine, prompts, greedy)
    model.use_fused_ops(None)
    plain = [engine_logits(engine, p) for p in prompts], run_engine(engine, prompts, greedy)
    for a, b in zip(fused[0], plain[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert fused[1] == plain[1]


# aten ops that launch no kernel on CUDA: views, and allocations.
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "t",
    "transpose", "expand", "unsqueeze", "squeeze", "permute", "as_strided", "alias",
    "detach", "empty", "empty_like", "empty_strided", "chunk", "_reshape_alias",
}  # fmt: skip


class Launches(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class CountingOps(TorchLayerOps):
    """The CUDA ops object's calls, each one Triton launch: counted, computed by the
    reference outside the dispatch count."""

    def __init__(self, launches: Launches) -> None:
        self.launches = launches

    def _launch(self, name: str, fn, *args):
        self.launches.ops.append(f"triton:{name}")
        with torch.utils._python_dispatch._disable_current_modes():
            return fn(*args)

    def rms_norm(self, *a):
        return self._launch("rms_norm", super().rms_norm, *a)

    def add_rms_norm(self, *a):
        return self._launch("add_rms_norm", super().add_rms_norm, *a)

    def rotary_write_kv(self, *a):
        return self._launch("rotary_write_kv", super().rotary_write_kv, *a)

    def silu_and_mul(self, *a):
        return self._launch("silu_and_mul", super().silu_and_mul, *a)


class CountingAttention:
    """A paged attention backend's launches, at most two: the Triton decode kernel, and its
    merge of a long row's splits (or flash-attn's one)."""

    def __init__(self, launches: Launches) -> None:
        self.launches = launches

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        assert meta.kv_written, "the fused ops wrote the KV: the backend must not"
        self.launches.ops += ["attention", "attention-merge"]
        with torch.utils._python_dispatch._disable_current_modes():
            return torch.empty_like(q)


def test_a_decoder_layer_on_the_cuda_ops_launches_at_most_twelve_kernels():
    from workers.model.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=1,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=256,
    )  # fmt: skip
    layer = DecoderLayer(cfg).to(torch.bfloat16)
    launches = Launches()
    layer.ops = CountingOps(launches)
    rope = RotaryEmbedding(64, 256, 1e5, None)
    batch = 16
    cache = torch.zeros(8, 2, 16, 3, 64, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(batch),
        num_decode_tokens=batch,
        decode_block_tables=torch.zeros(batch, 1, dtype=torch.long),
        decode_context_lens=torch.ones(batch, dtype=torch.long),
        prefills=[],
        kv_written=True,
    )
    x, delta = (
        torch.randn(batch, 576).to(torch.bfloat16),
        torch.randn(batch, 576).to(torch.bfloat16),
    )
    positions = torch.arange(batch)
    with torch.inference_mode(), launches:
        layer.forward_fused(
            delta, x, positions, rope, CountingAttention(launches), cache[:, 0], cache[:, 1], meta
        )
    kinds = sorted(launches.ops)
    assert len(kinds) <= 12, kinds  # 10: four matmuls, two norms, rotary+KV, attention (2), SiLU
    matmuls = sum(kinds.count(k) for k in ("mm", "addmm", "linear"))
    assert matmuls == 4, kinds  # qkv, o, gate_up, down
    assert {"triton:add_rms_norm", "triton:rotary_write_kv", "triton:silu_and_mul"} <= set(kinds)
    assert "index_put_" not in kinds and "mul" not in kinds, kinds  # nothing left unfused
