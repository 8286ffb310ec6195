"""Decode steps replayed from captured graphs equal eager steps. On the CPU the graphs are
`EagerReplay`, which re-runs the captured step on the same static buffers a CUDA graph reads:
the bucketing, padding rows, null block and buffer refills are what is checked here
(benchmarks/gpu_check.py checks real CUDA graphs on a GPU)."""

import pytest
import torch

from tests.reference import run_engine
from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import EagerReplay, batch_buckets
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams


def test_buckets_cover_every_batch_up_to_the_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    for limit in (1, 3, 9, 64):
        buckets = batch_buckets(limit)
        assert buckets[-1] == limit and all(any(b >= n for b in buckets) for n in range(limit))


class CountingReplay(EagerReplay):
    replays = 0

    def replay(self) -> None:
        CountingReplay.replays += 1
        super().replay()


@pytest.mark.parametrize("backend", ["torch", "torch-sdpa"])
def test_graph_decode_equals_eager(tiny_llama_dir, backend):
    """Greedy and seeded requests of different lengths, joining and leaving the batch (so
    its size crosses buckets, with padding rows), end with the same tokens either way; with a
    backend that is not graph-safe nothing is captured and the steps run eagerly."""
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 30, 1, 12)]
    samplings = [
        SamplingParams(max_tokens=m, temperature=t, seed=7, ignore_eos=True)
        for m, t in [(12, 0.0), (5, 0.8), (20, 0.0), (9, 1.0), (14, 0.0), (3, 0.7)]
    ]
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=5,  # six requests: one waits, and batches of 1..5 rows occur
        attention_backend=backend,
    )
    outs = {}
    for graphs in (False, True):
        engine = LLMEngine(cfg, make_graph=CountingReplay if graphs else None)
        if graphs:
            captured = engine.runner.graphs is not None
            assert captured == engine.runner.backend.graph_safe
            if captured:
                assert sorted(engine.runner.graphs.graphs) == [1, 2, 4, 5]
        CountingReplay.replays = 0
        ids = [engine.add_request(p, s) for p, s in zip(prompts, samplings)]
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
        outs[graphs] = [got[i] for i in ids]
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        if graphs and captured:
            assert CountingReplay.replays > 10  # decode steps did replay
    assert outs[True] == outs[False]
    assert [len(o) for o in outs[True]] == [s.max_tokens for s in samplings]


def test_padding_rows_never_touch_a_request_block(tiny_llama_dir):
    """The padding rows of a bucket write only the null block, which the pool never hands
    out: every block a request can hold is unchanged by them."""
    cfg = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=4, max_num_seqs=8)
    engine = LLMEngine(cfg, make_graph=EagerReplay)
    null = engine.runner.graphs.null_block
    assert null == engine.pool.num_blocks  # one past what the pool allocates
    for layer in engine.runner.kv_layers:
        assert layer.shape[0] == engine.pool.num_blocks + 1
        layer[:null].fill_(3.0)
    graphs = engine.runner.graphs
    # Three real rows in a bucket of four: row 3 is padding.
    cols = graphs.padded([1, 2, 3], [0, 0, 0], [0, 4, 8], [[0], [1], [2]], [1, 1, 1])
    assert cols[3][3] == [null] and cols[4][3] == 1  # the padding row: null block, length 1
    hidden = graphs.run(*(torch.tensor(c) for c in cols))
    assert hidden.shape[0] == 4
    for layer in engine.runner.kv_layers:
        assert torch.all(layer[3:null] == 3.0)  # blocks 0..2 took the three real rows
    run_engine(engine, [[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
