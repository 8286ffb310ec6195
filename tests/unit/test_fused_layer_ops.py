"""The fused CPU layer kernels against the torch ops they replace, alone and inside the model."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.reference import engine_logits, run_engine
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.model_runner import scatter_rows
from workers.engine.request import SamplingParams
from workers.model.cpu_kernels import cpu_kernels
from workers.model.llama import RMSNorm
from workers.model.rope import RotaryEmbedding

TOLS = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


@pytest.fixture(scope="module")
def ops():
    module = cpu_kernels()
    if module is None:
        pytest.skip("no C++ compiler: the kernels could not be built")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_blocks_matches_index_copy_and_checks_ids(ops, dtype):
    """A KV transfer's staged blocks (K and V side by side) into their reserved blocks:
    the same bytes as index_copy_."""
    cache = torch.randn(40, 2, 4, 3, 16).to(dtype)
    staged = torch.randn(5, 2, 4, 3, 16).to(dtype)
    blocks = torch.tensor([31, 2, 17, 39, 0])
    got = cache.clone()
    scatter_rows(got, blocks, staged, ops)
    want = cache.clone()
    scatter_rows(want, blocks, staged, None)  # the index_copy_ path
    assert torch.equal(got, want) and torch.equal(got[blocks], staged)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.scatter_blocks(got, torch.tensor([40]), staged[:1])


# Counts the threads of a fresh interpreter just after each call ran on a new thread of its
# own (an OpenMP team lives as long as the thread that started it). In the test process the
# count is not the kernel's alone: Ray's and gRPC's threads, from earlier tests, come and go.
_TEAM_PROBE = """
import json, os, sys, threading
import torch
from workers.model.cpu_kernels import cpu_kernels

ops = cpu_kernels()
dtype = getattr(torch, sys.argv[1])
cache = torch.randn(40, 3, 2, 4, 3, 16).to(dtype)[:, 1]
blocks = torch.tensor([31, 2, 17, 39, 0, 5, 6, 7] * 64)
got = torch.empty(len(blocks), *cache.shape[1:], dtype=dtype)


def threads_while(fn):
    seen = []

    def run():
        out = fn()
        seen.append((len(os.listdir("/proc/self/task")), out))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0]


idle, team = threads_while(torch.get_num_threads)  # a new thread's own thread count
gather, _ = threads_while(lambda: ops.gather_blocks(got, blocks, cache))
select, _ = threads_while(lambda: torch.index_select(cache, 0, blocks, out=got))
print(json.dumps({"idle": idle, "team": team, "gather": gather, "select": select}))
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_blocks_matches_index_select_on_one_thread(ops, dtype):
    """A transfer's blocks to be staged, out of a cache whose blocks are strided (one layer
    of a wider tensor): the same bytes as index_select, without an OpenMP team of the
    calling thread's own (index_select, this large, starts one where torch has threads)."""
    whole = torch.randn(40, 3, 2, 4, 3, 16).to(dtype)
    cache = whole[:, 1]  # block stride spans three layers
    blocks = torch.tensor([31, 2, 17, 39, 0, 5, 6, 7] * 64)
    want = torch.index_select(cache, 0, blocks)
    got = torch.empty_like(want)
    ops.gather_blocks(got, blocks, cache)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gather_blocks(got[:1], torch.tensor([40]), cache)
    with pytest.raises(RuntimeError, match="contiguous"):
        strided = torch.randn(40, 2, 4, 3, 32).to(dtype)[..., ::2]  # each block's rows apart
        ops.gather_blocks(got[:1], torch.tensor([0]), strided)

    root = Path(__file__).resolve().parents[2]
    probe = subprocess.run(
        [sys.executable, "-c", _TEAM_PROBE, str(dtype).removeprefix("torch.")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    counts = json.loads(probe.stdout.strip().splitlines()[-1])
    assert counts["gather"] == counts["idle"], counts
    if counts["team"] > 1:  # what the kernel avoids
        assert counts["select"] > counts["idle"], counts


def test_kernels_let_go_of_the_gil_while_they_run(ops):
    """Another Python thread of the process (a worker's KV sender, its token relay, a poll)
    runs while a kernel does: a long decode attention here. Bound as load_inline binds by
    default, a kernel held the GIL to its end, and the other thread stood still."""
    blocks, bs, kvh, d = 2048, 16, 4, 64
    k_cache, v_cache = torch.randn(blocks, bs, kvh, d), torch.randn(blocks, bs, kvh, d)
    width = 128  # blocks a sequence: 2,048 tokens
    stamps, stop = [], threading.Event()

    def spin():  # a time stamp every 64 turns of a pure-Python loop
        turns = 0
        while not stop.is_set():
            turns += 1
            if not turns % 64:
                stamps.append(time.perf_counter())

    def attend(batch: int) -> tuple[float, float]:
        tables = torch.randint(0, blocks, (batch, width))
        lens = torch.full((batch,), width * bs)
        q = torch.randn(batch, 2 * kvh, d)
        start = time.perf_counter()
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
        return start, time.perf_counter()

    batch = 64
    while batch < 4096:  # long enough to tell, on this machine (~100 ms on two cores)
        start, end = attend(batch)
        if end - start > 0.08:
            break
        batch *= 2
    else:
        pytest.skip("this machine runs the longest attention here in under 80 ms")
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        start, end = attend(batch)
    finally:
        stop.set()
        spinner.join(5)
    # Held, the GIL lets the spinner stamp only before the call, and after the kernel
    # returned (until this thread takes the GIL back), which can lie shortly before `end`:
    # count 10 ms bins over the call's middle, and ask for stamps in most of them.
    edge, width_s = 0.015, 0.010
    bins = int((end - start - 2 * edge) / width_s)
    hit = {int((t - start - edge) / width_s) for t in stamps if start + edge < t < end - edge}
    hit.discard(bins)  # a partial bin at the end
    assert bins >= 4
    assert len(hit) >= 0.6 * bins, f"the other thread ran in {len(hit)} of {bins} 10 ms bins"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paired", [False, True])
def test_write_slots_puts_a_steps_kv_rows_from_the_fused_qkv_into_their_slots(ops, dtype, paired):
    """A step's new K rows, columns of the fused QKV output (strided rows), into their slots
    of a cache whose blocks hold K alone or K and V side by side (the engine's layout): the
    same bytes as the torch version; out-of-range slots and non-contiguous rows are refused."""
    from workers.model.attention.base import slot_index

    torch.manual_seed(0)
    slots = torch.tensor([7, 0, 33, 12, 5, 39])
    qkv = torch.randn(6, 5 * 3 * 16).to(dtype)
    k = qkv[:, 2 * 48 : 3 * 48].view(6, 3, 16)  # rows 240 apart
    layer = torch.randn(10, 2, 4, 3, 16).to(dtype)
    cache = layer[:, 0] if paired else layer[:, 0].contiguous()
    want_layer = layer.clone()
    want = want_layer[:, 0] if paired else cache.clone()
    want[slot_index(slots, 4)] = k  # the torch ops the backends use without the kernels
    ops.write_slots(cache, slots, k)
    assert torch.equal(cache, want)
    if paired:
        assert torch.equal(layer, want_layer)  # the V halves untouched
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_slots(cache, torch.tensor([40]), k[:1])
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.write_slots(cache, slots, k.transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_blocks_takes_strided_rows(ops, dtype):
    """Rows of a wider tensor (strided) into their places: the same bytes as index_copy_; a
    slice that is not contiguous is refused."""
    slots = torch.tensor([7, 0, 33, 12, 5])
    qkv = torch.randn(5, 5 * 3 * 16).to(dtype)
    k = qkv[:, 2 * 48 : 3 * 48].view(5, 3, 16)  # rows 240 apart
    cache = torch.randn(40, 3, 16).to(dtype)
    want = cache.clone().index_copy_(0, slots, k)
    ops.scatter_blocks(cache, slots, k)
    assert torch.equal(cache, want)
    ops.scatter_blocks(cache, slots[:0], k[:0])  # no rows: nothing written, no error
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.scatter_blocks(cache, slots, k.transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.parametrize("dtype, tol", TOLS)
def test_norms(ops, dtype, tol):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    for rows in (1, 37):
        x = torch.randn(rows, 64).to(dtype)
        delta = torch.randn(rows, 64).to(dtype)
        torch.testing.assert_close(
            ops.rms_norm(x, norm.weight, norm.eps), norm(x), atol=tol, rtol=tol
        )
        residual, delta_before = x.clone(), delta.clone()
        out = ops.add_rms_norm(delta, residual, norm.weight, norm.eps)
        assert torch.equal(residual, x + delta)  # the sum, rounded to the dtype, in place
        torch.testing.assert_close(out, norm(x + delta), atol=tol, rtol=tol)
        assert torch.equal(delta, delta_before)  # the delta is left alone


@pytest.mark.parametrize("dtype, tol", TOLS)
def test_rotary_in_place_on_fused_qkv_columns(ops, dtype, tol):
    torch.manual_seed(1)
    heads, kv_heads, dim = 6, 2, 16
    rope = RotaryEmbedding(dim, 256, 10000.0, None)
    qkv = torch.randn(9, (heads + 2 * kv_heads) * dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 50, 51, 7, 255, 3, 3])
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    want_q, want_k = rope(positions, q.clone(), k.clone())
    ops.rotary_inplace(q, positions, rope.cos, rope.sin)
    ops.rotary_inplace(k, positions, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="past the table"):
        ops.rotary_inplace(q, torch.tensor([256] * 9), rope.cos, rope.sin)


@pytest.mark.parametrize("dtype, tol", TOLS)
def test_silu_and_mul(ops, dtype, tol):
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * 48).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, atol=tol, rtol=tol)


def test_model_on_kernels_equals_model_on_torch_ops(ops, tiny_model_dir):
    """Same checkpoint, same weights: logits close and greedy outputs equal whether the layers
    run on the fused kernels or on torch ops (llama, llama3-scaled, qwen2 with qkv bias)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, block_size=4))
    model = engine.runner.model
    assert model.ops is ops
    prompts = [[1, 504, 3575, 282, 4649, 314], list(range(100, 160))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fused = [engine_logits(engine, p) for p in prompts], run_engine(engine, prompts, greedy)
    model.use_fused_ops(None)
    plain = [engine_logits(engine, p) for p in prompts], run_engine(engine, prompts, greedy)
    for a, b in zip(fused[0], plain[0]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert fused[1] == plain[1]


def test_argmax_rows_equals_torch_argmax(ops):
    """Greedy picks: the first index of each row's maximum, ties and NaN as torch has them."""
    torch.manual_seed(0)
    x = torch.randn(7, 49157)  # not a multiple of 16: the tail lanes count
    x[1, 100] = x[1, 40000] = 50.0  # a tie: the first wins
    x[2, -1] = 60.0  # the maximum in the tail
    x[3, 5] = x[3, 9000] = float("nan")  # NaN is the maximum, the first one
    x[4] = float("-inf")  # every token banned
    x[5, 0] = 70.0
    x[6] = 0.0
    x[6, 3] = -0.0  # -0 == 0: the first zero
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(3, 2 * 1000)[:, :1000]  # strided rows
    assert torch.equal(ops.argmax_rows(wide), wide.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x[:0]), x[:0].argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(x.double())
