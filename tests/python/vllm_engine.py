"""One offline vLLM engine in a process of its own, for tests/python/test_vllm.py (and by
hand).  Reads a JSON job from stdin, writes a JSON answer to the file named by argv[1]:

    {"model": DIR, "nexuskv": {"NEXUSKV_VLLM_KEY_BITS": "8", ...} or null (stock CPU_ATTN),
     "llm": {extra vllm.LLM arguments},
     "greedy": {"prompts": [...], "max_tokens": 32},     -> token ids and their logprobs
     "ppl": {"prompt_token_ids": [...]},                  -> prompt logprobs and perplexity
     "prefix": {"prompt_token_ids": [...], "max_tokens": 16}}  -> a prefix-cache miss, then a hit

A process per engine: vLLM keeps process-wide state (its config, the plugins, the
attention backend selection) that a second engine in the same process would inherit.

    python vllm_engine.py --forkserver

imports vLLM once (measured: each engine then starts 4-6 s sooner than a fresh interpreter) and then,
for each request line on stdin ({"env": {...}, "job": {...}, "out": PATH, "log": PATH}),
forks a process that replaces its environment with env, sends its stdout and stderr to
log, runs the job as above and exits; the server answers {"returncode": N} on a line.  No
engine ever runs in the server itself, so each fork starts from the state of a process
that has only imported vLLM, as a fresh one would (vLLM reads its settings, and nexuskv's
plugin its own, when an engine is made).  A job over JOB_TIMEOUT_S is killed (SIGALRM)."""

import json
import math
import os
import signal
import sys
import traceback

JOB_TIMEOUT_S = 900


def _margin(lp) -> float:
    top = sorted((x.logprob for x in lp.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def _summary(o) -> dict:
    """Greedy token ids, their log-probabilities, the text, and per step the top-1 minus
    top-2 log-probability (how near a tie the greedy choice was)."""
    return {
        "ids": list(o.token_ids),
        "logprobs": [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)],
        "margins": [_margin(lp) for lp in o.logprobs],
        "text": o.text,
    }


def run(job: dict, out_path: str) -> None:
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
        sp = SamplingParams(temperature=0.0, max_tokens=g.get("max_tokens", 32), logprobs=2, ignore_eos=True)
        res = llm.generate(g["prompts"], sp, use_tqdm=False)
        out["greedy"] = [_summary(r.outputs[0]) for r in res]
    if "ppl" in job:
        ids = job["ppl"]["prompt_token_ids"]
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        r = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        lps = [plp[t].logprob for plp, t in zip(r.prompt_logprobs[1:], ids[1:])]
        out["ppl"] = {"logprobs": lps, "ppl": math.exp(-sum(lps) / len(lps))}
    if "prefix" in job:
        p = job["prefix"]
        sp = SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", 16), logprobs=2, ignore_eos=True)
        runs = []
        llm.reset_prefix_cache()
        for _ in range(2):
            r = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]}], sp, use_tqdm=False)[0]
            runs.append(dict(_summary(r.outputs[0]), cached=r.num_cached_tokens or 0))
        out["prefix"] = runs
    with open(out_path, "w") as f:
        json.dump(out, f)


def forkserver() -> None:
    import vllm  # noqa: F401  (imported once, before any fork)

    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the engine's process
            code = 1
            try:
                os.setpgid(0, 0)  # a group of its own: what it spawns goes with it (below)
                log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1), os.dup2(log, 2)
                sys.stdin.close()
                os.environ.clear()
                os.environ.update(req["env"])
                signal.alarm(JOB_TIMEOUT_S)
                run(req["job"], req["out"])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        try:  # (the child does it too: whichever runs first)
            os.setpgid(pid, pid)
        except OSError:  # the child has already done it, or has exited
            pass
        _, status = os.waitpid(pid, 0)
        # An engine with VLLM_ENABLE_V1_MULTIPROCESSING (the tensor-parallel jobs) runs its core
        # and workers in processes of their own, which outlive the engine's os._exit (seen: three
        # 1.7 GB workers left per tensor-parallel job, and a later engine killed for memory).
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left of the group
            pass
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--forkserver"]:
        forkserver()
    else:
        run(json.load(sys.stdin), sys.argv[1])
