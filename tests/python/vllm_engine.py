"""One offline vLLM engine in a process of its own, for tests/python/test_vllm.py (and by
hand).  Reads a JSON job from stdin, writes a JSON answer to the file named by argv[1]:

    {"model": DIR, "nexuskv": {"NEXUSKV_VLLM_KEY_BITS": "8", ...} or null (stock CPU_ATTN),
     "llm": {extra vllm.LLM arguments},
     "greedy": {"prompts": [...], "max_tokens": 32},     -> token ids and their logprobs
     "ppl": {"prompt_token_ids": [...]},                  -> prompt logprobs and perplexity
     "prefix": {"prompt": "...", "max_tokens": 16}}       -> a prefix-cache miss, then a hit

A process per engine: vLLM keeps process-wide state (its config, the plugins, the
attention backend selection) that a second engine in the same process would inherit."""

import json
import math
import os
import sys


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.update({k: str(v) for k, v in (job.get("nexuskv") or {}).items()})
    from vllm import LLM, SamplingParams

    kw = dict(model=job["model"], dtype="bfloat16", max_model_len=2048, enforce_eager=True, seed=0)
    if job.get("nexuskv") is not None:
        kw["attention_config"] = {"backend": "CUSTOM"}
    kw.update(job.get("llm", {}))
    llm = LLM(**kw)
    out = {}
    if "greedy" in job:
        g = job["greedy"]
        sp = SamplingParams(temperature=0.0, max_tokens=g.get("max_tokens", 32), logprobs=0, ignore_eos=True)
        res = llm.generate(g["prompts"], sp, use_tqdm=False)
        out["greedy"] = [
            {
                "ids": list(r.outputs[0].token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)],
                "text": r.outputs[0].text,
            }
            for r in res
        ]
    if "ppl" in job:
        ids = job["ppl"]["prompt_token_ids"]
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        r = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        lps = [plp[t].logprob for plp, t in zip(r.prompt_logprobs[1:], ids[1:])]
        out["ppl"] = {"logprobs": lps, "ppl": math.exp(-sum(lps) / len(lps))}
    if "prefix" in job:
        p = job["prefix"]
        sp = SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", 16), logprobs=0, ignore_eos=True)
        runs = []
        llm.reset_prefix_cache()
        for _ in range(2):
            r = llm.generate([p["prompt"]], sp, use_tqdm=False)[0]
            o = r.outputs[0]
            runs.append(
                {
                    "ids": list(o.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)],
                    "cached": r.num_cached_tokens or 0,
                }
            )
        out["prefix"] = runs
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
