"""`tandem doctor` on this machine (a CPU, no GPU): a CPU config needs nothing missing; a GPU
config is told plainly what it lacks, with exit status 1."""

import json

from cluster.cli import build_parser, main
from cluster.config import load_config
from cluster.doctor import examine


def config(*flags):
    return load_config(None, build_parser().parse_args(["doctor", *flags]))


def test_a_cpu_config_finds_what_it_needs_here(capsys):
    report = examine(config("--device", "cpu"))
    offered = dict(report.offers)
    assert offered["torch"].startswith("2.") and "no GPU visible" in offered["CUDA"]
    assert "pages of a multiple of 256" in offered["flash-attn"]
    assert "prefill workers" in dict(report.needs) and not report.missing
    assert main(["doctor", "--device", "cpu"]) == 0
    assert "OK: nothing the config needs is missing" in capsys.readouterr().out


def test_a_gpu_config_on_a_cpu_names_every_lack(capsys):
    flags = ["--device", "cuda", "--prefill-gpus", "1", "--decode-gpus", "1", "--decode", "2"]
    report = examine(config(*flags))
    text = "\n".join(report.missing)
    assert "the pools want 3 (a whole GPU per worker), this machine has 0" in text
    assert "no GPU is visible here" in text
    assert "NCCL" in text  # a CPU build of torch has none
    needs = dict(report.needs)
    assert needs["decode workers"] == (
        "cuda, bfloat16, KV blocks of 256 tokens, attention auto, on 2 x 1 GPU"
    )
    assert main(["doctor", *flags, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["missing"] == report.missing


def test_an_unreachable_redis_is_missing_and_its_password_not_shown():
    report = examine(config("--redis-url", "redis://:hunter2@127.0.0.1:1/0"))
    [missing] = report.missing
    assert missing.startswith("Redis at redis://") and "hunter2" not in missing
    assert "hunter2" not in dict(report.needs)["Redis"]


def test_fp8_on_a_gpu_config_here_is_refused_and_the_offer_says_why(capsys):
    assert main(["doctor", "--quantization", "fp8"]) == 1  # device auto: the CPU here
    assert "compute capability 8.9" in capsys.readouterr().out
    report = examine(config("--quantization", "fp8", "--prefill-gpus", "1", "--decode-gpus", "1"))
    assert "no GPU is visible here" in "\n".join(report.missing)
    assert "none visible here" in dict(report.offers)["fp8 weights (CUDA)"]
