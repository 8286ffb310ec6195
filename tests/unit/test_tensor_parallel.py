"""Tensor parallelism's parts, in one process: how the model is split (every head, channel
and token id held by exactly the ranks that need it), the shared-memory collectives, and a
split model's logits against the whole model's, its ranks run as threads."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch

from workers.engine.model_runner import ModelRunner
from workers.model import shm_collectives
from workers.model.config import ModelConfig
from workers.model.loader import build_model, resolve_model
from workers.model.shm_collectives import ShmCollectives, create_segment
from workers.model.tensor_parallel import Shard, tp_refusal

pytestmark = pytest.mark.timeout(300)


def model_config(heads: int, kv_heads: int, inter: int = 96, vocab: int = 1001) -> ModelConfig:
    return ModelConfig(vocab, 64, inter, 2, heads, kv_heads, 16)


@pytest.mark.parametrize(
    "heads,kv_heads,tp",
    [(9, 3, 2), (9, 3, 3), (32, 8, 4), (32, 8, 8), (32, 8, 16), (4, 2, 4), (8, 1, 8), (6, 6, 4)],
)
def test_every_head_channel_and_token_is_held_where_it_is_read(heads, kv_heads, tp):
    cfg = model_config(heads, kv_heads)
    shards = [Shard.of(cfg, r, tp) for r in range(tp)]
    group = heads // kv_heads
    held_q = sorted(h for s in shards for h in range(s.q_heads[0], sum(s.q_heads)))
    assert held_q == list(range(heads))  # each query head on exactly one rank
    for s in shards:
        kv = range(s.kv_heads[0], sum(s.kv_heads))
        for h in range(s.q_heads[0], sum(s.q_heads)):
            assert h // group in kv  # each query head reads a KV head its rank holds
        local = s.local_config(cfg)  # what the rank's layers are built for
        assert local.num_heads % local.num_kv_heads == 0
        if tp <= kv_heads:  # whole groups; past that, one KV head and part of its group
            assert local.num_heads // local.num_kv_heads == group
        else:
            assert local.num_kv_heads == 1 and local.num_heads == heads // tp
    held_kv = {h for s in shards for h in range(s.kv_heads[0], sum(s.kv_heads))}
    assert held_kv == set(range(kv_heads))
    for part, total in (("mlp", cfg.intermediate_size), ("vocab", cfg.vocab_size)):
        runs = sorted(getattr(s, part) for s in shards)
        assert sum(n for _, n in runs) == total
        assert all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:]))
    sizes = [s.mlp[1] for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_a_split_that_leaves_a_rank_no_vocabulary_is_refused():
    assert tp_refusal(model_config(4, 4, vocab=9), 4) is not None  # chunks of 3: 3, 3, 3, 0
    assert tp_refusal(model_config(4, 4, vocab=10), 4) is None  # 3, 3, 3, 1


def test_a_misshapen_checkpoint_tensor_is_named_before_a_rank_takes_its_part(tiny_llama_dir):
    from workers.model.config import CheckpointError
    from workers.model.loader import assemble_model, read_checkpoint

    cfg, tensors = read_checkpoint(resolve_model(str(tiny_llama_dir)))
    name = "model.layers.1.mlp.down_proj.weight"
    rank1 = Shard.of(cfg, 1, 2)
    for bad in (tensors[name][:, :-2], torch.cat([tensors[name]] * 2, dim=1)):
        broken = {**tensors, name: bad}.items()
        with pytest.raises(CheckpointError, match=r"'layers\.1\.mlp\.down_proj\.weight' has"):
            assemble_model(cfg, broken, torch.float32, torch.device("cpu"), "t", shard=rank1)


@pytest.mark.parametrize("heads,kv_heads,tp", [(9, 3, 4), (9, 3, 6), (8, 2, 3), (4, 2, 8)])
def test_a_split_that_would_break_a_head_is_refused_naming_the_heads(heads, kv_heads, tp):
    cfg = model_config(heads, kv_heads)
    why = tp_refusal(cfg, tp)
    if tp <= kv_heads:  # 8 heads, 2 KV heads over 3 ranks: runs of KV heads, never refused
        assert why is None or "heads" in why
        return
    assert why is not None and f"{kv_heads} KV heads" in why
    with pytest.raises(ValueError, match="KV heads"):
        Shard.of(cfg, 0, tp)


def _segment(size: int) -> str:
    return create_segment(f"tandem-test-{uuid.uuid4().hex}", size)


def _run_ranks(size: int, work, timeout_s: float = 30.0):
    """work(rank, collectives) on `size` threads sharing one segment; their results."""
    path = _segment(size)
    comms = [ShmCollectives(path, r, size, timeout_s) for r in range(size)]
    os.unlink(path)
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = work(r, comms[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in comms:
        c.close()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [2, 3])
def test_shm_all_reduce_sums_in_rank_order_the_same_bits_on_every_rank(dtype, size, monkeypatch):
    monkeypatch.setattr(shm_collectives, "SLOT_BYTES", 2048)  # 1,500 values: 3 or 2 pieces
    parts = [torch.randn(3, 500, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def work(r, comm):
        out = []
        for _ in range(4):  # consecutive reductions reuse both buffers
            t = parts[r].to(dtype, copy=True)
            assert comm.all_reduce(t) is t
            out.append(t)
        return out

    results = _run_ranks(size, work)
    want = parts[0].to(dtype) + parts[1].to(dtype)
    for p in parts[2:]:
        want = want + p.to(dtype)
    for per_rank in results:
        for got in per_rank:
            assert torch.equal(got, want)


def test_shm_all_gather_puts_each_ranks_columns_in_place_and_drops_the_padding(monkeypatch):
    monkeypatch.setattr(shm_collectives, "SLOT_BYTES", 256)  # rows go through in pieces
    width, size = 10, 3  # chunks of 4, 4 and 2 columns
    full = torch.arange(7 * width, dtype=torch.float32).view(7, width)

    def work(r, comm):
        shard = Shard.of(model_config(9, 3, vocab=width), r, size)
        start, count = shard.vocab
        return comm.all_gather_columns(full[:, start : start + count].clone(), width)

    for got in _run_ranks(size, work):
        assert torch.equal(got, full)


def test_shm_wait_ends_when_a_rank_is_known_dead_or_at_its_timeout():
    path = _segment(2)
    alive = ShmCollectives(path, 0, 2, 60.0, peers_alive=lambda: False)
    with pytest.raises(RuntimeError, match=r"a rank died \(ranks \[1\]"):
        alive.all_reduce(torch.ones(4))
    late = ShmCollectives(path, 0, 2, 0.3)
    late.count = alive.count  # the same rank, one collective on
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not reach"):
        late.all_reduce(torch.ones(4))
    os.unlink(path)
    alive.close()
    late.close()


def _prompt_logits(model, ids) -> torch.Tensor:
    runner = ModelRunner(model, 8, 16, torch.device("cpu"))
    return runner.prompt_logits(ids, list(range(-(-len(ids) // 16))))


@pytest.mark.parametrize("tp", [2, 4])
def test_split_model_logits_equal_the_whole_models(tiny_model_dir, tp):
    """Every rank's logits, joined over the whole vocabulary, equal tp 1's (fp32, to rounding)
    and each other's bit for bit; each rank read only its part."""
    src = resolve_model(str(tiny_model_dir))
    cpu = torch.device("cpu")
    ids = [1, 517, 40, 3012, 88, 9, 77, 4000, 12, 5, 61, 300, 2048, 7, 19, 42, 100]
    whole = _prompt_logits(build_model(src, torch.float32, cpu), ids)
    shards = [build_model(src, torch.float32, cpu, tp=(r, tp)) for r in range(tp)]
    assert shards[0].embed_tokens.weight.shape[0] == whole.shape[1] // tp

    def work(r, comm):
        shards[r].use_collectives(comm)
        return _prompt_logits(shards[r], ids)

    results = _run_ranks(tp, work)
    for got in results:
        assert torch.equal(got, results[0])
    torch.testing.assert_close(results[0], whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(results[0].argmax(-1), whole.argmax(-1))


def test_benchmarks_run_each_tandem_system_once_per_tp():
    from benchmarks.common import quantized_runs, unquantized_label

    full = {"quantization": "none", "kv_cache_dtype": "auto"}
    runs = quantized_runs(["tandem", "tandem-unpacked", "vllm"], "none", "auto", "1,2")
    assert runs == [
        ("tandem", "tandem", full),
        ("tandem-tp2", "tandem", {**full, "tp": 2}),
        ("tandem-unpacked", "tandem-unpacked", full),
        ("tandem-unpacked-tp2", "tandem-unpacked", {**full, "tp": 2}),
        ("vllm", "vllm", full),  # one rank: tp is Tandem's
    ]
    assert unquantized_label("tandem-tp2", runs) == "tandem"
    for bad in ("two", "0,1"):
        with pytest.raises(ValueError, match="--tp"):
            quantized_runs(["tandem"], "none", "auto", bad)
