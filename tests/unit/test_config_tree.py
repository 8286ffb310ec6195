"""The config tree: every field can be set from the file and from a flag, both generated
from the dataclasses, and every error names the field by its path."""

import argparse
import dataclasses

import pytest

from cluster import config_io
from cluster.cli import build_parser
from cluster.config import FLAT, KV_LAYOUT, ClusterConfig, load_config
from workers.engine.config import EngineConfig
from workers.messages import Pool


def other_value(leaf: config_io.Leaf):
    """A valid value for the field that differs from its default."""
    default = config_io._default(leaf.field)
    choices = config_io.choices(leaf)
    if choices:
        return next(c for c in choices if c != default)
    special = {
        "engine.device": "cuda:0",
        "prefill.gpus": 1.0,
        "decode.gpus": 1.0,
        "engine.model": "/models/llama",
        "engine.block_size": 32,
        "engine.max_model_len": 1024,
        "redis.url": "rediss://:s3cret@redis.example:6380/2",
        "router.port": 6000,
        "prefill.autoscale.signal": "ttft_p90",
        "decode.autoscale.signal": "tpot_p90",
        "engine.prefill_share": 0.25,
        "router.tenants.tier_ttft_slo_ms": {"0": 500.0},
        "router.tenants.tier_tpot_slo_ms": {"0": 50.0},
    }
    name = leaf.name.replace("prefill.engine.", "engine.").replace("decode.engine.", "engine.")
    if name in special:  # a pool's engine field takes what the shared one does
        return special[name]
    base = leaf.base
    if base is bool:
        return not default
    if base is int:
        return (default or 1) + 3
    if base is float:
        return (default or 1.0) + 0.5
    if base is dict:
        return {"custom": 2.0}
    return "x"


def flag_text(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def get(cfg, path):
    for p in path:
        cfg = getattr(cfg, p)
    return cfg


def leaf_cases():
    """Every field a cluster takes other values of (a colocated-only field takes its default
    alone in the default, disaggregated, cluster: test_tp_needs_a_colocated_cluster)."""
    return [
        pytest.param(leaf, id=leaf.name)
        for leaf in config_io.leaves(ClusterConfig)
        if not leaf.field.metadata.get("colocated_only")
    ]


def test_tp_needs_a_colocated_cluster_and_a_gpu_per_rank():
    only = [x for x in config_io.leaves(ClusterConfig) if x.field.metadata.get("colocated_only")]
    assert [x.name for x in only] == ["engine.tp", "prefill.engine.tp", "decode.engine.tp"]
    with pytest.raises(ValueError, match=r"config field engine\.tp: 2: .*handoff between rank"):
        ClusterConfig(engine=EngineConfig(tp=2))
    with pytest.raises(ValueError, match=r"config field decode\.engine\.tp: 2: .*colocated"):
        config_io.load(ClusterConfig, None, {"decode": {"engine": {"tp": 2}}})
    parser = argparse.ArgumentParser()
    config_io.add_flags(parser, ClusterConfig, FLAT)
    flags = ["--mode", "colocated", "--decode-tp", "2", "--decode-cpus", "4"]
    engine = load_config(None, parser.parse_args(flags)).engine_for(Pool.DECODE)
    assert (engine.tp, engine.num_threads) == (2, 2)  # the worker's 4 CPUs, 2 per rank
    per_rank = load_config(None, parser.parse_args([*flags, "--num-threads", "3"]))
    assert per_rank.engine_for(Pool.DECODE).num_threads == 3  # engine.num_threads: each rank's
    colocated = {"mode": "colocated", "decode": {"cpus": 1, "engine": {"tp": 2}}}
    with pytest.raises(ValueError, match=r"decode\.cpus: 1: a worker of tp 2 runs 2 processes"):
        config_io.load(ClusterConfig, None, colocated)
    on_gpus = {"mode": "colocated", "decode": {"gpus": 1, "engine": {"tp": 2}}}
    with pytest.raises(ValueError, match=r"decode\.gpus: 1: a worker of tp 2 runs a rank per"):
        config_io.load(ClusterConfig, None, on_gpus)
    on_gpus["decode"]["gpus"] = 2
    assert config_io.load(ClusterConfig, None, on_gpus).engine_for(Pool.DECODE).tp == 2
    on_gpus["engine"] = {"device": "cuda:1"}
    with pytest.raises(ValueError, match=r"engine\.device: 'cuda:1': .* its 2 ranks take 2"):
        config_io.load(ClusterConfig, None, on_gpus)


def test_a_pools_engine_fields_override_the_shared_ones_for_that_pool_alone(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "engine: {max_num_seqs: 32, prefill_chunk_size: 256}\n"
        "prefill: {engine: {prefill_chunk_size: 1024}}\n"
        "decode: {engine: {max_num_seqs: 96, policy: priority}}\n"
    )
    parser = argparse.ArgumentParser()
    config_io.add_flags(parser, ClusterConfig, FLAT)
    cfg = load_config(str(f), parser.parse_args(["--decode-max-num-seqs", "128"]))
    prefill, decode = (cfg.engine_for(p) for p in (Pool.PREFILL, Pool.DECODE))
    assert (prefill.max_num_seqs, prefill.prefill_chunk_size, prefill.policy) == (32, 1024, "fcfs")
    assert (decode.max_num_seqs, decode.prefill_chunk_size, decode.policy) == (128, 256, "priority")
    # A choice spelled like null is the choice: the pool's full-width weights, not the shared int8.
    f.write_text("engine: {quantization: int8}\nprefill: {engine: {quantization: none}}\n")
    cfg = load_config(str(f))
    assert cfg.engine_for(Pool.PREFILL).quantization == "none"
    assert cfg.engine_for(Pool.DECODE).quantization == "int8"


@pytest.mark.parametrize("name,value", [("block_size", 32), ("dtype", "bfloat16")])
@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_pools_that_would_hand_off_kv_of_two_layouts_are_refused_naming_the_field(
    pool, name, value
):
    other = "decode" if pool == "prefill" else "prefill"
    want = rf"config field {pool}\.engine\.{name}: '?{value}'? against the {other} pool's"
    with pytest.raises(ValueError, match=want + ".*one layout"):
        config_io.load(ClusterConfig, None, {pool: {"engine": {name: value}}})
    both = {p: {"engine": {name: value}} for p in ("prefill", "decode")}
    assert getattr(config_io.load(ClusterConfig, None, both).engine_for(Pool.DECODE), name) == value
    colocated = {"mode": "colocated", "decode": {"engine": {name: value}}}
    assert (
        getattr(config_io.load(ClusterConfig, None, colocated).engine_for(Pool.DECODE), name)
        == value
    )


def test_a_pools_invalid_engine_is_refused_naming_the_pool_or_the_shared_section():
    bad = {"enable_chunked_prefill": False, "prefill_share": 0.5}
    with pytest.raises(ValueError, match=r"decode\.engine: prefill_share .* enable_chunked"):
        config_io.load(ClusterConfig, None, {"decode": {"engine": bad}})
    with pytest.raises(ValueError, match=r"flags: engine: prefill_share .* enable_chunked"):
        config_io.load(ClusterConfig, None, {"engine": bad})
    colocated = {"mode": "colocated", "prefill": {"engine": {"max_num_seqs": 8}}}
    with pytest.raises(ValueError, match=r"prefill\.engine: max_num_seqs: a colocated .* decode"):
        config_io.load(ClusterConfig, None, colocated)


def nest(path, value):
    out = value
    for p in reversed(path):
        out = {p: out}
    return out


def companions(leaf, value) -> dict:
    """What makes a field's value valid with the rest: fp16 needs CUDA; a CUDA worker, a
    whole GPU of its own; both pools on one kind of device; TLS, a certificate and its key."""
    if leaf.name == "engine.dtype" and value == "float16":
        return {"engine.device": "cuda", "prefill.gpus": 1.0, "decode.gpus": 1.0}
    if leaf.name == "engine.device":
        return {"prefill.gpus": 1.0, "decode.gpus": 1.0}
    if leaf.name in ("prefill.gpus", "decode.gpus"):
        return {"prefill.gpus": value, "decode.gpus": value}
    pool_field = leaf.name.split(".engine.")
    if len(pool_field) == 2 and pool_field[1] in KV_LAYOUT:  # both pools carry one layout
        return {f"{p}.engine.{pool_field[1]}": value for p in ("prefill", "decode")}
    if leaf.name.startswith("router.tls_"):  # a certificate and its key go together
        return {"router.tls_cert": "cert.pem", "router.tls_key": "key.pem", leaf.name: value}
    return {}


def valid(leaf, value) -> dict:
    """The overrides for one field, plus what makes them valid together."""
    values = nest(leaf.path, value)
    for name, more in companions(leaf, value).items():
        values = config_io.merge(values, nest(tuple(name.split(".")), more))
    return values


@pytest.mark.parametrize("leaf", leaf_cases())
def test_every_field_can_be_set_from_the_file(leaf, tmp_path):
    import yaml

    value = other_value(leaf)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(valid(leaf, value)))
    assert get(load_config(str(path)), leaf.path) == value


@pytest.mark.parametrize("leaf", leaf_cases())
def test_every_field_can_be_set_from_a_flag(leaf):
    value = other_value(leaf)
    parser = argparse.ArgumentParser()
    config_io.add_flags(parser, ClusterConfig, FLAT)
    [flag, *_] = config_io.flag_names(leaf, FLAT)
    if leaf.base is bool:
        argv = [flag if value else "--no-" + flag[2:]]
    else:
        argv = [flag, flag_text(value)]
    leaves = {x.name: x for x in config_io.leaves(ClusterConfig)}
    for name, more in companions(leaf, value).items():
        argv += [config_io.flag_names(leaves[name], FLAT)[0], flag_text(more)]
    cfg = load_config(None, parser.parse_args(argv))
    assert get(cfg, leaf.path) == value


def test_flags_are_unique_and_tandem_up_has_them_all():
    names = [
        n for leaf in config_io.leaves(ClusterConfig) for n in config_io.flag_names(leaf, FLAT)
    ]
    assert len(names) == len(set(names))
    up_help = build_parser()._subparsers._group_actions[0].choices["up"].format_help()
    for n in names:
        assert n in up_help, n


def test_file_then_flags_and_errors_name_the_field(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('mode = "colocated"\n[engine]\nblock_size = 32\n[decode]\nreplicas = 2\n')
    args = build_parser().parse_args(["up", "--block-size", "8", "--decode", "3"])
    cfg = load_config(str(f), args)
    assert (cfg.mode, cfg.engine.block_size, cfg.decode.replicas) == ("colocated", 8, 3)
    bad = [
        ({"engine": {"block_size": 3}}, "engine: block_size=3: must be a positive power of two"),
        ({"engine": {"blok_size": 16}}, "unknown config field(s) engine.blok_size"),
        ({"engine": {"block_size": "big"}}, "engine.block_size='big': expected int"),
        ({"router": {"max_retries": -1}}, "router: max_retries=-1: must be >= 0"),
        ({"router": {"max_in_flight": 0}}, "router: max_in_flight=0: must be at least 1"),
        ({"prefill": {"replicas": 0}}, "prefill.replicas: a disaggregated cluster needs"),
        ({"redis": {"url": "http://x"}}, "redis: url='http://x'"),
        ({"dashboard": "maybe"}, "dashboard='maybe': expected true or false"),
        ({"engine": 5}, "engine must be a mapping"),
    ]
    for values, message in bad:
        with pytest.raises(config_io.ConfigError) as e:
            config_io.build(ClusterConfig, values, "c.yaml")
        assert message in str(e.value), (values, str(e.value))


def test_the_scheduler_config_derives_from_the_engines():
    e = EngineConfig(max_num_seqs=7, prefill_chunk_size=64, policy="priority")
    s = e.scheduler(max_model_len=300)
    fields = {f.name for f in dataclasses.fields(s)} - {"max_model_len", "watermark"}
    assert all(getattr(s, f) == getattr(e, f) for f in fields)
    assert s.max_model_len == 300
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        EngineConfig(max_num_batched_tokens=0)


def test_generate_offline_takes_every_engine_field_as_a_flag():
    from cluster.cli import engine_config

    args = build_parser().parse_args(
        ["generate", "--offline", "--no-enable-prefix-caching", "--kv-cache-gb", "0.5", "hi"]
    )
    cfg = engine_config(args)
    assert cfg.enable_prefix_caching is False and cfg.kv_cache_gb == 0.5
    gen_help = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for leaf in config_io.leaves(EngineConfig):
        assert config_io.flag_names(leaf, frozenset())[0] in gen_help, leaf.name
