"""Runs the offline workload through vLLM's LLM.generate, in its default compiled mode or eager
(`enforce_eager` in the job). Executed with the vLLM virtualenv's Python by
offline_throughput.py; reads a JSON job on stdin, prints one JSON result line.
(vLLM starts its engine core in a spawned process that re-imports this file: hence the guard.)"""

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        max_num_seqs=job["max_batch"],
        max_model_len=job.get("max_model_len", 2048),
        seed=0,
        enforce_eager=job.get("enforce_eager", False),
        kv_cache_memory_bytes=int(job.get("kv_cache_gb", 1.0) * 2**30),
    )
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in job["requests"]]
    params = [
        SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        for r in job["requests"]
    ]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    runs = []
    for i in range(job["runs"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"seconds": dt, "output_tokens": tokens})
        print(f"  run {i + 1}/{job['runs']}: {tokens} tokens in {dt:.1f} s", file=sys.stderr)
    print("RESULT " + json.dumps({"runs": runs}), flush=True)


if __name__ == "__main__":
    main()
