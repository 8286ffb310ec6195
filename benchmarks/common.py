"""Shared benchmark plumbing: the workload, the model exported once as an HF folder so every
system loads identical weights, and result tables."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_VLLM_PYTHON = Path(
    os.environ.get(
        "TANDEM_VLLM_PYTHON", Path.home() / ".cache" / "tandem" / "vllm-venv" / "bin" / "python"
    )
)


def vllm_env(threads: int | None) -> dict[str, str]:
    """The environment for a vLLM process. vLLM's CPU backend binds its model worker to all
    cores but one by default (`VLLM_CPU_OMP_THREADS_BIND=auto`), keeping that one for its
    scheduler process: on two cores, one compute thread. With `threads`, its worker is bound
    to cores 0..threads-1, the threads Tandem computes on, and nothing is reserved, so both run
    on the same threads; None keeps vLLM's own default."""
    env = dict(os.environ)
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def run_worker(name: str, cmd: list[str], job: dict, timeout: float, env=None):
    """Run one system's worker process: the job as JSON on stdin, its `RESULT <json>` line
    read back. Returns (payload, None), or (None, why it failed)."""
    import subprocess

    log(f"[{name}] starting")
    try:
        proc = subprocess.run(
            cmd,
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]), None
    tail = (proc.stderr or proc.stdout)[-2000:]
    log(f"[{name}] failed (exit {proc.returncode}):\n{tail}")
    return None, f"exit {proc.returncode}: {tail[-500:]}"


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def machine() -> dict:
    """The CPU the figures were taken on: its model, the instruction sets Tandem's kernels
    choose between, and the cores torch may use. Recorded beside every benchmark's figures."""
    from workers.model.cpu_kernels import cpu_info

    model, flags = cpu_info()
    return {
        "cpu": model,
        "flags": [f for f in ISA_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def describe_machine(m: dict) -> str:
    return f"{m['cpu']} ({', '.join(m['flags']) or 'no AVX2'}), {m['cores']} cores"


def quantizations(text: str, choices: tuple[str, ...] | None = None, flag="--quantization"):
    """A comma-separated list of `flag`'s values (the engine's QUANTIZATIONS by default), each
    once, in order. Raises ValueError naming an unknown value."""
    from workers.model.quantization import QUANTIZATIONS

    choices = choices or QUANTIZATIONS
    values = list(dict.fromkeys(q for q in text.split(",") if q))
    if not values or set(values) - set(choices):
        raise ValueError(f"{flag} {text!r}: choose from {', '.join(choices)}")
    return values


def add_tp_flag(parser) -> None:
    """--tp, for the benchmarks that run Tandem's offline engine (quantized_runs reads it)."""
    parser.add_argument(
        "--tp",
        default="1",
        help="Tandem's tensor-parallel ranks, comma-separated: each Tandem system once per "
        "value, labelled -tpN (the threads are shared out among a run's ranks)",
    )


def quantized_runs(
    systems: list[str], quantization: str, kv_cache_dtype: str = "auto", tp: str = "1"
) -> list[tuple[str, str, dict]]:
    """(label, system, settings) for each run: every Tandem system that runs Tandem's CPU
    kernels once per --quantization, --kv-cache-dtype and --tp value (labelled `system-int8`,
    `system-fp8kv`, `system-int8-fp8kv-tp2` and so on; `none`, `auto` and 1 keep the
    system's name), every other system once, at full width on one rank. settings: the
    engine's quantization and kv_cache_dtype, and tp where it is not 1."""
    from workers.model.quantization import KV_CACHE_DTYPES

    weights = quantizations(quantization)
    caches = quantizations(kv_cache_dtype, KV_CACHE_DTYPES, "--kv-cache-dtype")
    try:
        ranks = [int(t) for t in tp.split(",")]
    except ValueError:
        raise ValueError(f"--tp {tp!r}: whole numbers of ranks, comma-separated") from None
    if min(ranks) < 1:
        raise ValueError(f"--tp {tp!r}: 1 or more ranks")
    runs = []
    for s in systems:
        tandem = s.startswith("tandem") and "unpacked" not in s
        for q in weights if tandem else ["none"]:
            for kv in caches if tandem else ["auto"]:
                for n in ranks if s.startswith("tandem") else [1]:
                    suffix = ("" if q == "none" else f"-{q}") + ("" if kv == "auto" else f"-{kv}kv")
                    settings = {"quantization": q, "kv_cache_dtype": kv}
                    if n > 1:
                        suffix, settings["tp"] = suffix + f"-tp{n}", n
                    runs.append((s + suffix, s, settings))
    return runs


FULL_WIDTH = {"quantization": "none", "kv_cache_dtype": "auto"}


def unquantized_label(label: str, runs: list[tuple[str, str, dict]]) -> str | None:
    """The label of the same system's full-width run, for a quantized run's ratio."""
    system = next((s for lab, s, st in runs if lab == label and st != FULL_WIDTH), None)
    return system if system is not None and any(lab == system for lab, _, _ in runs) else None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def export_default_model(out_dir: Path) -> Path:
    """Dequantize the default GGUF once into an HF folder (config.json, model.safetensors,
    tokenizer) that Tandem, transformers and vLLM all load: the same weights for everyone."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    import torch
    from safetensors.torch import save_file

    from workers.model.loader import read_checkpoint, resolve_model
    from workers.model.tokenizer import Tokenizer

    src = resolve_model(None)
    cfg, tensors = read_checkpoint(src)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0],
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        str(out_dir / "model.safetensors"),
    )
    Tokenizer(src).hf.save_pretrained(out_dir)
    log(f"exported the default model to {out_dir}")
    return out_dir


def default_gguf() -> Path:
    """The default model's own file: a GGUF whose matrices are Q4_1 (the embedding Q8_0)."""
    from workers.model.loader import resolve_model

    return resolve_model(None).path


def tandem_model(job: dict, quantization: str) -> str:
    """What a Tandem run loads: the default GGUF itself for quantization gguf (its blocks
    served as stored), else the HF export every system loads (`job["model_dir"]`)."""
    return str(default_gguf()) if quantization == "gguf" else job["model_dir"]


def export_gguf(qtype: str, out: Path) -> Path:
    """The default model as a GGUF whose matrices are `qtype` (Q8_0, Q4_0, Q4_1): its metadata
    and tokenizer copied as they are, each quantized matrix dequantized and quantized again
    (the same weights as the default file's, give or take the new type's rounding), vectors
    as stored. Written once; llama.cpp and Tandem both load it."""
    if out.is_file():
        return out
    import gguf
    import numpy as np

    src = default_gguf()
    reader = gguf.GGUFReader(str(src))
    target = gguf.GGMLQuantizationType[qtype]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}.get(qtype, value)
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        if len(shape) < 2:  # vectors (norms, biases) as stored
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if t.tensor_type != target:
            writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    log(f"wrote the default model in {qtype} to {out}")
    return out


def load_workload(path: Path, model_dir: Path, limit: int | None = None) -> list[dict]:
    """Requests as {prompt_ids, max_tokens}: prompts go through the chat template once, here,
    so every system sees the same token ids."""
    from cluster.requests_file import read_requests
    from workers.model.loader import ModelSource
    from workers.model.tokenizer import Tokenizer

    tok = Tokenizer(ModelSource(model_dir))
    rows = []
    for r in read_requests(path)[:limit]:
        ids = list(r.prompt_ids) if r.prompt_ids is not None else tok.encode_chat(r.prompt)
        rows.append({"prompt_ids": ids, "max_tokens": r.sampling.max_tokens})
    return rows


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile of xs (None left out) as the nearest rank below; nan if empty."""
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else float("nan")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
