"""One llama.cpp measurement, run by benchmarks/llamacpp.py in llama.cpp's own environment
(llama-cpp-python; nothing of Tandem's is imported here).

Reads a job as JSON on stdin: {"gguf", "prompts": [[token ids]...], "max_tokens", "threads",
"runs"}. All prompts are prefilled, then decoded together, one token per sequence per step,
greedy (the argmax of each row's logits), EOS ignored: the batched decode of llama.cpp's
`llama-batched-bench`, through its C API (llama_batch with a sequence id per row; one KV
stream per sequence). Writes {"runs": [{"wall_s", "prefill_s", "decode_s", "tokens"}...],
"system_info", "version", "outputs": [[token ids]...]} on stdout, as one `RESULT <json>` line.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp as L
import numpy as np


def main() -> None:
    job = json.load(sys.stdin)
    prompts: list[list[int]] = job["prompts"]
    n, steps, threads = len(prompts), job["max_tokens"], job["threads"]
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(job["gguf"].encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {job['gguf']}")
    per_seq = max(len(p) for p in prompts) + steps + 16
    cp = L.llama_context_default_params()
    cp.n_ctx = per_seq * n
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = n
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(512, n), 0, n)

    def submit(rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decodes (token, position, sequence, wants logits) rows, 512 at a time; returns the
        argmax token of each row that wanted logits, in order."""
        picked = []
        for start in range(0, len(rows), 512):
            chunk = rows[start : start + 512]
            batch.n_tokens = len(chunk)
            for i, (tok, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i] = tok, pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = logits
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            for i, (_, _, _, logits) in enumerate(chunk):
                if logits:
                    ptr = L.llama_get_logits_ith(ctx, i)
                    row = np.ctypeslib.as_array(
                        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,)
                    )
                    picked.append(int(row.argmax()))
        return picked

    def generate() -> tuple[float, float, list[list[int]]]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        rows = [
            (tok, pos, s, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        last = submit(rows)
        t1 = time.perf_counter()
        out = [[t] for t in last]
        for step in range(1, steps):
            last = submit([(last[s], len(prompts[s]) + step - 1, s, True) for s in range(n)])
            for s, t in enumerate(last):
                out[s].append(t)
        return t1 - t0, time.perf_counter() - t1, out

    generate()  # warm-up: first-touch of weights and buffers
    runs, outputs = [], []
    for _ in range(job["runs"]):
        prefill, decode, outputs = generate()
        runs.append(
            {
                "wall_s": prefill + decode,
                "prefill_s": prefill,
                "decode_s": decode,
                "tokens": n * steps,
            }
        )
    result = {
        "runs": runs,
        "outputs": outputs,
        "version": L.__version__,
        "system_info": L.llama_print_system_info().decode(),
    }
    print("RESULT " + json.dumps(result), flush=True)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
