"""A GPU configuration is right when it loads or refused then, naming its field: what
flash-attn takes, whole GPUs per CUDA worker, both pools on one kind of device, and what
`auto` resolves to; and the attention backend is chosen once, at start, saying why."""

import pytest

from cluster import config_io
from cluster.config import ClusterConfig
from workers.engine.config import EngineConfig
from workers.messages import Pool
from workers.model.attention.selector import choose_backend


def cluster(engine=None, prefill=None, decode=None, mode="disaggregated") -> ClusterConfig:
    values = {"mode": mode, "engine": engine or {}, "prefill": prefill or {}}
    values["decode"] = decode or {}
    return config_io.build(ClusterConfig, values, "c.yaml")


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"attention_backend": "flash-attn", "block_size": 16}, "block_size=16"),
        ({"attention_backend": "flash-attn", "block_size": 128}, "block_size=128"),
        ({"attention_backend": "flash-attn", "dtype": "float32"}, "dtype='float32'"),
        ({"attention_backend": "flash-attn", "device": "cpu"}, "attention_backend='flash-attn'"),
        ({"device": "gpu"}, "device='gpu'"),
        ({"device": "cpu", "dtype": "float16"}, "dtype='float16'"),
        ({"block_size": 24}, "block_size=24"),
    ],
)
def test_engine_refusals_name_their_field(fields, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        EngineConfig(**fields)
    with pytest.raises(config_io.ConfigError, match="engine: " + named):
        cluster(engine=fields)


def test_flash_attn_takes_its_own_pages_and_types():
    cfg = EngineConfig(attention_backend="flash-attn", block_size=512, dtype="float16")
    assert cfg.resolve(cuda=True).block_size == 512
    left = EngineConfig(attention_backend="flash-attn").resolve(cuda=True)
    assert (left.device, left.dtype, left.block_size) == ("cuda", "bfloat16", 256)
    with pytest.raises(ValueError, match="runs on CUDA only"):  # auto found no GPU
        EngineConfig(attention_backend="flash-attn").resolve(cuda=False)


def test_a_gpu_without_bf16_gets_fp16_unless_the_dtype_is_given():
    older = EngineConfig().resolve(cuda=True, bf16=False)
    assert (older.device, older.dtype, older.block_size) == ("cuda", "float16", 256)
    assert EngineConfig(dtype="bfloat16").resolve(cuda=True, bf16=False).dtype == "bfloat16"
    assert EngineConfig().resolve(cuda=False, bf16=False).dtype == "float32"


@pytest.mark.parametrize(
    "engine, cuda, want",
    [
        ({}, False, ("cpu", "float32", 16)),
        ({}, True, ("cuda", "bfloat16", 256)),
        ({"dtype": "bfloat16", "block_size": 32}, True, ("cuda", "bfloat16", 32)),
        ({"device": "cpu"}, True, ("cpu", "float32", 16)),
        ({"device": "cuda:0", "dtype": "float16"}, False, ("cuda:0", "float16", 256)),
    ],
)
def test_auto_resolves_to_what_the_device_takes(engine, cuda, want):
    got = EngineConfig(**engine).resolve(cuda=cuda)
    assert (got.device, got.dtype, got.block_size) == want
    with pytest.raises(ValueError, match="dtype='float16' is for GPUs"):
        EngineConfig(dtype="float16").resolve(cuda=False)


@pytest.mark.parametrize(
    "engine, prefill, decode, named",
    [
        ({"device": "cuda"}, {"gpus": 0}, {"gpus": 1}, "prefill.gpus: 0: engine.device='cuda'"),
        ({"device": "cuda"}, {"gpus": 1}, {}, "decode.gpus: 0: engine.device='cuda' needs"),
        ({}, {"gpus": 0.5}, {"gpus": 0.5}, "prefill.gpus: 0.5: GPUs are whole"),
        ({}, {"gpus": 1}, {"gpus": 1.5}, "decode.gpus: 1.5: GPUs are whole"),
        ({"device": "cpu"}, {"gpus": 1}, {}, "prefill.gpus: 1: engine.device='cpu'"),
        ({"device": "cuda:1"}, {"gpus": 1}, {"gpus": 1}, "engine.device: 'cuda:1'"),
        ({"device": "cuda"}, {"gpus": 1}, {"gpus": 2}, "decode.gpus: 2: a worker of tp 1 runs"),
        ({}, {"gpus": 1}, {"gpus": 0}, "decode.gpus: the prefill pool runs on cuda"),
    ],
)
def test_cluster_refusals_name_their_field(engine, prefill, decode, named):
    with pytest.raises(config_io.ConfigError, match=named.replace("(", r"\(")):
        cluster(engine, prefill, decode)


def test_each_pool_runs_its_resolved_engine():
    cfg = cluster({}, {"gpus": 1}, {"gpus": 1})
    for pool in (Pool.PREFILL, Pool.DECODE):
        e = cfg.engine_for(pool)
        # The dtype is the worker's to pick, for its own GPU (the head may have none).
        assert (e.device, e.dtype, e.block_size, e.num_threads) == ("cuda", "auto", 256, None)
        assert e.resolve(bf16=True).dtype == "bfloat16" and e.resolve(bf16=False).dtype == "float16"
        assert e.cuda_graphs == (pool is Pool.DECODE)  # prefill never steps decodes alone
        # A GPU prefill worker takes a whole prompt, up to the step's budget, in one step.
        whole = e.max_num_batched_tokens if pool is Pool.PREFILL else 512
        assert e.prefill_chunk_size == whole
    cpu = cluster({}, {"cpus": 2, "threads": 3}, {"cpus": 2})
    pe, de = cpu.engine_for(Pool.PREFILL), cpu.engine_for(Pool.DECODE)
    assert (pe.device, pe.dtype, pe.block_size, pe.num_threads) == ("cpu", "float32", 16, 3)
    assert pe.prefill_chunk_size == de.prefill_chunk_size == 512  # on a CPU, as configured
    assert de.num_threads == 2  # its cpus
    # Colocated: only the decode pool runs, so the prefill pool's GPUs are not checked.
    colo = cluster({"device": "cuda"}, {"gpus": 0}, {"gpus": 1}, mode="colocated")
    assert colo.engine_for(Pool.DECODE).device == "cuda"


@pytest.mark.parametrize(
    "args, want, why",
    [
        (("auto", "cpu", None), "torch", "flash-attn is for CUDA"),
        (("auto", "cuda", None, "bfloat16", 256, 64, (9, 0)), "flash-attn", "installed"),
        (("auto", "cuda", "flash-attn is not installed"), "torch", "not installed"),
        (("auto", "cuda", None, "bfloat16", 16, 64, (9, 0)), "torch", "block_size=16"),
        (("auto", "cuda", None, "float32", 256, 64, (9, 0)), "torch", "dtype='float32'"),
        (("auto", "cuda", None, "bfloat16", 256, 72 * 4, (9, 0)), "torch", "head_dim=288"),
        (("auto", "cuda", None, "bfloat16", 256, 64, (7, 5)), "torch", "capability 7.5"),
        (("torch-sdpa", "cuda", None), "torch-sdpa", "asked for"),
        (("flash-attn", "cuda", "flash-attn is not installed"), "flash-attn", "asked for"),
    ],
)
def test_auto_takes_flash_attn_only_where_it_runs(args, want, why):
    chosen, reason = choose_backend(*args)
    assert chosen == want and why in reason


def test_unknown_or_misplaced_backends_are_refused():
    with pytest.raises(ValueError, match="'flash' is unknown"):
        choose_backend("flash", "cuda", None)
    with pytest.raises(ValueError, match="CUDA devices only"):
        choose_backend("flash-attn", "cpu", None)
