"""What quantization costs in accuracy: perplexity on a held-out public-domain text, and greedy
agreement with the full-width model, for each --quantization and --kv-cache-dtype, in one run.

    python benchmarks/quality.py [--quantization none,int8,gguf] [--kv-cache-dtype auto]
        [--dtype bfloat16] [--gguf-type Q4_1] [--tokens 50000] [--window 1024] [--prompts 32]
        [--max-tokens 64] [--text benchmarks/texts/sherlock_holmes.txt] [--out F.json]

The model is the default one, from a GGUF file of --gguf-type: Q4_1 is its own file, another
type (Q8_0, Q4_0) the same weights written in it once (benchmarks/common.py's export_gguf).
`none` dequantizes the file at load, `gguf` serves its blocks as stored, `int8` quantizes the
dequantized weights per output channel.

Perplexity: the text's body (between Project Gutenberg's START and END lines) is tokenized,
cut to --tokens, and scored in windows of --window tokens, each teacher-forced from its own
start through the engine's paged-cache path (`LLMEngine.prompt_logits`): exp of the mean
negative log-likelihood of every token after a window's first.

Greedy agreement: the first --prompts prompts of the offline workload, --max-tokens each
(EOS ignored), through each configuration's engine; against the first configuration (the
full-width one): the share of sequences identical, and the mean share of each sequence's
tokens before its first difference.

Targets: perplexity within 1% of bf16 for int8 and an fp8 KV cache, within 3% for 4-bit.
A configuration is named by its weights, and `+fp8kv` for an fp8 cache. Writes JSON to
benchmarks/results/quality.json, with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    ROOT,
    default_gguf,
    describe_machine,
    export_gguf,
    load_workload,
    log,
    machine,
    print_table,
    quantized_runs,
)

TEXT = ROOT / "benchmarks" / "texts" / "sherlock_holmes.txt"


def body(text: str) -> str:
    """A Project Gutenberg file's body: between its START and END lines (the whole text if
    it has none)."""
    lines = text.splitlines()
    start = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("*** START OF")), 0)
    end = next((i for i, ln in enumerate(lines) if ln.startswith("*** END OF")), len(lines))
    return "\n".join(lines[start:end]).strip()


def perplexity(engine, ids: list[int], window: int) -> tuple[float, int]:
    """(perplexity, tokens scored) over `ids` in windows of `window` tokens."""
    import torch

    nll, scored = 0.0, 0
    for i, start in enumerate(range(0, len(ids) - 1, window)):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = engine.prompt_logits(chunk)
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= logprobs.gather(1, target[:, None]).double().sum().item()
        scored += len(chunk) - 1
        if i % 10 == 0:
            log(f"    window {i + 1}: perplexity so far {math.exp(nll / scored):.3f}")
    return math.exp(nll / scored), scored


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from workers.engine.request import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    out = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[rid] for rid in ids]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(b), 1))
    return {
        "identical": sum(a == b for a, b in zip(ours, ref)) / len(ref),
        "mean_prefix": sum(prefix) / len(prefix),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quantization", default="none,int8,gguf")
    p.add_argument("--kv-cache-dtype", default="auto", help="comma-separated: auto, fp8")
    p.add_argument("--gguf-type", default="Q4_1", help="the GGUF file's type (Q4_1: the default)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--tokens", type=int, default=50000, help="tokens of the text scored")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    args = p.parse_args()
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine

    try:
        runs = quantized_runs(["tandem"], args.quantization, args.kv_cache_dtype)
    except ValueError as e:
        p.error(str(e))
    configs = {
        st["quantization"] + ("+fp8kv" if st["kv_cache_dtype"] == "fp8" else ""): st
        for _, _, st in runs
    }
    if args.tokens < 2 or args.window < 2 or args.prompts < 1 or args.max_tokens < 1:
        p.error("--tokens and --window need at least 2, --prompts and --max-tokens 1")
    if not args.text.is_file():
        p.error(f"--text {args.text}: no such file")
    model = default_gguf()
    if args.gguf_type != "Q4_1":
        try:
            model = export_gguf(
                args.gguf_type, RESULTS / f"smollm2-135m-instruct-{args.gguf_type.lower()}.gguf"
            )
        except (KeyError, NotImplementedError) as e:
            p.error(f"--gguf-type {args.gguf_type}: cannot be written ({e})")
    m = machine()
    log(f"{describe_machine(m)}; {model.name}, {args.dtype}, configurations {list(configs)}")
    blocks = -(-args.window // 16) + 64 * -(-(args.max_tokens + 2048) // 16)
    results, reference = {}, None
    for q, settings in configs.items():
        t0 = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=str(model),
                device="cpu",  # int8 is the CPU's: every configuration on the same device
                dtype=args.dtype,
                **settings,
                num_kv_blocks=blocks,
                num_threads=args.threads,
                max_num_seqs=args.prompts,
            )
        )
        ids = engine.tokenizer.encode(body(args.text.read_text()))[: args.tokens]
        if len(ids) < args.tokens:
            log(f"  the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
        log(f"[{q}] perplexity over {len(ids)} tokens in windows of {args.window}")
        ppl, scored = perplexity(engine, ids, args.window)
        prompts = [
            r["prompt_ids"]
            for r in load_workload(
                ROOT / "benchmarks/workloads/offline_default.jsonl",
                engine.source.path,
                args.prompts,
            )
        ]
        log(f"[{q}] greedy, {len(prompts)} prompts x {args.max_tokens} tokens")
        tokens = greedy(engine, prompts, args.max_tokens)
        if reference is None:
            reference = tokens
        results[q] = {
            "perplexity": ppl,
            "tokens_scored": scored,
            "greedy": agreement(tokens, reference),
            "seconds": time.perf_counter() - t0,
        }
        log(f"[{q}] perplexity {ppl:.4f} ({time.perf_counter() - t0:.0f} s)")
        del engine
    first = next(iter(configs))
    base = results[first]["perplexity"]
    rows = [
        [
            q,
            f"{r['perplexity']:.4f}",
            f"{100 * (r['perplexity'] / base - 1):+.2f}%",
            f"{100 * r['greedy']['identical']:.0f}%",
            f"{100 * r['greedy']['mean_prefix']:.0f}%",
        ]
        for q, r in results.items()
    ]
    print(describe_machine(m))
    print_table(
        [
            "weights",
            "perplexity",
            f"vs {first}",
            "greedy sequences identical",
            "tokens before a difference",
        ],
        rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"} | {
        "text": str(args.text),
        "model": str(model),
    }
    args.out.write_text(json.dumps({"config": config, "machine": m, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
