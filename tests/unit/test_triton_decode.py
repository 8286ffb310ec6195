"""The Triton paged decode kernel (workers/model/attention/triton_decode.py) against a torch
reference read from the same paged cache.

Without a GPU the kernel runs in triton's CPU interpreter, in a subprocess: TRITON_INTERPRET
must be set before triton is imported, and this process may have imported it already. The
subprocess runs every check and prints a JSON report, one entry per check. On a CUDA machine
the same checks also run compiled, with a CUDA graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.unit import triton_checks

# (H, KVH, D): groups of 1, 3 (SmolLM2's 9 over 3), 4 and 16 (the kernel's whole padded
# group); D=80 pads to 128 in the kernel.
HEADS = [(2, 2, 64), (9, 3, 80), (8, 2, 64), (16, 1, 128)]
# Per block size: one token, exactly one block, several whole blocks, a partial last block,
# past one 64-token tile, and past one split (SPLIT_TOKENS, 256: merged across splits).
LENS = {1: [1, 3, 70], 4: [1, 4, 12, 70, 300], 16: [1, 16, 48, 64, 70], 256: [1, 256, 300, 530]}
# (atol, rtol). fp32: ieee dot, no tf32 rounding. bf16: the output is rounded to nearest bf16
# (up to 2^-8 relative), and so is p before p @ v (the rest: found up to 2.0e-3).
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (4e-3, 2**-8)}


@dataclass
class Case:
    q: torch.Tensor  # [B, H, D], a view into a fused qkv row
    k_cache: torch.Tensor  # layer[:, 0] of one [N, 2, bs, KVH, D] tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, W]: scattered ids, padded columns hold other valid ids
    lens: torch.Tensor
    scale: float

    def args(self, rows: slice = slice(None)) -> tuple:
        return self.q[rows], self.k_cache, self.v_cache, self.tables[rows], self.lens[rows]


def paged_case(dtype, block_size, heads, kv_heads, dim, lens, seed, device="cpu") -> Case:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 4
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(num_blocks, (len(lens), max(need) + 2), generator=gen)
    # NaN wherever no token was written: a kernel that reads past a row's length shows it.
    layer = torch.full((num_blocks, 2, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    for row, (n, blocks) in enumerate(zip(lens, order[: sum(need)].split(need))):
        tables[row, : len(blocks)] = blocks
        pos = torch.arange(n)
        kv = torch.randn(n, 2, kv_heads, dim, generator=gen)
        layer[tables[row, pos // block_size], :, pos % block_size] = kv.to(dtype)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv.to(device)[:, : heads * dim].view(len(lens), heads, dim)
    index = torch.int32 if block_size in (4, 256) else torch.int64  # both kinds of table
    layer = layer.to(device)
    return Case(
        q,
        layer[:, 0],
        layer[:, 1],
        tables.to(device, index),
        torch.tensor(lens, dtype=index, device=device),
        dim**-0.5,
    )


def reference(c: Case) -> torch.Tensor:
    """Each row's keys gathered through its table up to its length, KV heads repeated, fp64."""
    block_size, group = c.k_cache.shape[1], c.q.shape[1] // c.k_cache.shape[2]
    rows = []
    for row in range(c.q.shape[0]):
        pos = torch.arange(int(c.lens[row]), device=c.q.device)
        blocks = c.tables[row].long()[pos // block_size]
        k = c.k_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        v = c.v_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        p = (torch.einsum("hd,lhd->hl", c.q[row].double(), k) * c.scale).softmax(-1)
        rows.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(rows)


def excess_error(got: torch.Tensor, c: Case) -> float:
    """How far `got` strays from the reference past its dtype's tolerance (<= 0 passes)."""
    atol, rtol = TOL[got.dtype]
    want = reference(c)
    return ((got.double() - want).abs() - rtol * want.abs()).max().item() - atol


def check_reference(device: str) -> None:
    from workers.model.attention.triton_decode import paged_decode_attention

    for dtype in TOL:
        for i, (block_size, lens) in enumerate(LENS.items()):
            for j, (heads, kv_heads, dim) in enumerate(HEADS):
                c = paged_case(dtype, block_size, heads, kv_heads, dim, lens, 10 * i + j, device)
                assert not c.q.is_contiguous()
                got = paged_decode_attention(*c.args(), c.scale)
                assert got.dtype == dtype and got.shape == c.q.shape
                err = excess_error(got, c)
                what = f"{dtype} block_size={block_size} H={heads} KVH={kv_heads} D={dim}"
                assert err <= 0, f"{what}: error {err:.3g} past the tolerance {TOL[dtype]}"


def check_batch_invariance(device: str) -> None:
    """A row alone, its table cut to its own blocks, gives the bits it gives in a batch."""
    from workers.model.attention.triton_decode import paged_decode_attention

    lens = [70, 1, 33, 600, 16, 5, 64, 257, 17, 2]  # two rows of three and two splits
    for dtype, block_size, (heads, kv_heads, dim) in [
        (torch.bfloat16, 16, HEADS[1]),
        (torch.float32, 4, HEADS[2]),
    ]:
        c = paged_case(dtype, block_size, heads, kv_heads, dim, lens, 7, device)
        batch = paged_decode_attention(*c.args(), c.scale)
        for row, n in enumerate(lens):
            q, k_cache, v_cache, tables, row_lens = c.args(slice(row, row + 1))
            tables = tables[:, : -(-n // block_size)]
            alone = paged_decode_attention(q, k_cache, v_cache, tables, row_lens, c.scale)
            assert torch.equal(alone, batch[row : row + 1]), f"{dtype}: row {row} differs alone"


def check_long_rows(device: str) -> None:
    """Past MAX_SPLITS splits of SPLIT_TOKENS, a row's splits grow (4,200 tokens: 14 splits
    of 320); beside rows of one split, of three, and on either side of a split's end and of
    the 16th split's (512/513, 4,096/4,097), against the reference."""
    from workers.model.attention.triton_decode import paged_decode_attention

    c = paged_case(torch.bfloat16, 16, *HEADS[1], [4200, 1, 300, 512, 513, 4096, 4097], 5, device)
    got = paged_decode_attention(*c.args(), c.scale)
    err = excess_error(got, c)
    assert err <= 0, f"long rows: error {err:.3g} past the tolerance {TOL[torch.bfloat16]}"


def check_out_in_place(device: str) -> None:
    from workers.model.attention.triton_decode import paged_decode_attention

    c = paged_case(torch.bfloat16, 16, *HEADS[1], LENS[16], 3, device)
    want = paged_decode_attention(*c.args(), c.scale)
    batch, heads, dim = want.shape
    backing = torch.full((batch, heads + 1, dim), 7.0, dtype=want.dtype, device=device)
    out = backing[:, 1:]  # a strided view: the head before it must stay put
    got = paged_decode_attention(*c.args(), c.scale, out=out)
    assert got is out and torch.equal(out, want), "out= was not written in place"
    assert (backing[:, 0] == 7).all(), "a write outside out="


def check_first_launch(device: str) -> None:
    from workers.model.attention.triton_decode import triton_refusal

    for heads, kv_heads, dim in HEADS:
        why = triton_refusal(torch.device(device), torch.bfloat16, heads, kv_heads, dim, 16)
        assert why is None, f"H={heads} KVH={kv_heads} D={dim}: refused: {why}"


CHECKS = {
    "reference": check_reference,
    "batch_invariance": check_batch_invariance,
    "long_rows": check_long_rows,
    "out_in_place": check_out_in_place,
    "first_launch": check_first_launch,
}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return triton_checks.interpreted("tests.unit.test_triton_decode", "cpu")


@pytest.mark.parametrize("check", CHECKS)
def test_interpreted(interpreted: dict[str, str], check: str) -> None:
    assert interpreted[check] == "ok", interpreted[check]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernel: needs a CUDA GPU")
def test_compiled_on_cuda() -> None:
    pytest.importorskip("triton", reason="triton is not installed: no kernel to test")
    assert triton_checks.run_checks(CHECKS, "cuda") == dict.fromkeys(CHECKS, "ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: needs a CUDA GPU")
@pytest.mark.parametrize(
    "written, captured, replayed",
    [
        ([70, 17, 33], [70, 5, 33], [64, 17, 1]),  # one split a row: row 1 grew
        ([600, 17, 33], [5, 17, 33], [600, 17, 1]),  # row 0 grew from one split to three
    ],
)
def test_cuda_graph_replay_follows_new_lengths(written, captured, replayed) -> None:
    """Captured once, replayed after the lengths and queries change in place on the device;
    a row that grows past a split is merged by the captured merge launch."""
    pytest.importorskip("triton", reason="triton is not installed: no kernel to test")
    from workers.model.attention.triton_decode import paged_decode_attention

    # Every token the replay reads is written (the rest are NaN).
    c = paged_case(torch.bfloat16, 16, *HEADS[1], written, 11, "cuda")
    c.lens.copy_(torch.tensor(captured))
    out = torch.empty(c.q.shape, dtype=c.q.dtype, device="cuda")
    paged_decode_attention(*c.args(), c.scale, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*c.args(), c.scale, out=out)
    c.lens.copy_(torch.tensor(replayed))
    c.q.copy_(torch.randn(c.q.shape, device="cuda").to(c.q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    err = excess_error(out, c)
    assert err <= 0, f"replay: error {err:.3g} past the tolerance"


@pytest.mark.parametrize(
    "heads, kv_heads, dim, named",
    [(32, 1, 64, "groups of 1..16"), (9, 2, 64, "groups of 1..16"), (8, 8, 512, "head_dim 512")],
)
def test_shapes_the_kernel_does_not_take_are_refused_before_any_launch(heads, kv_heads, dim, named):
    from workers.model.attention.triton_decode import triton_refusal

    why = triton_refusal(torch.device("cpu"), torch.bfloat16, heads, kv_heads, dim, 16)
    assert why is not None and named in why


def test_a_kernel_that_cannot_compile_leaves_cuda_decodes_on_sdpa(monkeypatch):
    """Found at start, as the backend is built, never at the first decode step."""
    from workers.model.attention import triton_decode
    from workers.model.attention.base import HeadShape
    from workers.model.attention.torch_backend import TorchAttentionBackend

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC\nmore")

    from workers.model import triton_base

    monkeypatch.setattr(triton_base, "triton_unavailable", lambda: None)
    monkeypatch.setattr(triton_decode, "paged_decode_attention", no_compiler)
    why = triton_decode.triton_refusal(torch.device("cpu"), torch.bfloat16, 9, 3, 64, 256)
    assert (
        why
        == "its first launch failed: RuntimeError: Failed to find C compiler. Please specify via CC"
    )
    shape = HeadShape(9, 3, 64, 256, torch.bfloat16)
    backend = TorchAttentionBackend(torch.device("cuda"), shape=shape)
    assert backend.paged_decode is None and not backend.graph_safe
