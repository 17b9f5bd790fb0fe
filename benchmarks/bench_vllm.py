"""Serving benchmark: vLLM's CPU engine with its stock KV cache against nexuskv's
compressed pages, under one KV-cache budget small enough that the stock cache must queue
or preempt requests.

For each configuration the script starts `vllm serve` on 127.0.0.1 (the launcher of
scripts/install_vllm.sh), sends N streaming /v1/completions requests with Poisson
arrivals and fixed prompt / output lengths (loopback only, bounded in count and time),
stops the server, and reports requests/s (and its ratio to the stock backend's), output
tokens/s, P50/P95 time to first token, inter-token latency and request latency (arrival to
last token), KV bytes per token and the concurrency the budget holds (from
the server's "KV cache size" line), and preemptions (from /metrics).  Prints a table,
writes JSON.

    build/venv-vllm/bin/python benchmarks/bench_vllm.py --requests 24 --rate 2 \\
        --prompt-len 256 --output-len 64 --kv-mib 64 --out results/bench_vllm.json

Configurations: stock (bf16 CPU_ATTN), nexuskv 4-bit (its default exact window of 8; -w0: none)
and 2-bit (--configs to choose).
The budget is --kv-mib MiB through --kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE takes
whole GiB only, which holds tens of thousands of SmolLM2 tokens)."""

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "stock": None,
    "nexuskv-4bit": {"NEXUSKV_VLLM_KEY_BITS": "4", "NEXUSKV_VLLM_VALUE_BITS": "4"},  # exact window: auto (8)
    "nexuskv-4bit-w0": {"NEXUSKV_VLLM_KEY_BITS": "4", "NEXUSKV_VLLM_VALUE_BITS": "4", "NEXUSKV_VLLM_EXACT_WINDOW": "0"},
    "nexuskv-2bit": {"NEXUSKV_VLLM_KEY_BITS": "2", "NEXUSKV_VLLM_VALUE_BITS": "2"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_server(args, name, env_extra, log_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXUSKV_VLLM_")}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(env_extra or {})
    cmd = [
        args.launcher,
        "serve",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory-bytes",
        str(args.kv_mib << 20),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if not args.compile:
        cmd.append("--enforce-eager")
    if env_extra is not None:
        cmd += ["--attention-backend", "CUSTOM"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: server exited {proc.returncode}; see {log_path}")
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{name}: server not up in {args.startup_timeout} s; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url, log
        except OSError:
            time.sleep(2)


def one_request(url, model, prompt_ids, output_len, timeout, result):
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
        result.update(ok=True, start=t0, stamps=stamps)
    except Exception as e:  # counted as a failed request
        result.update(ok=False, start=t0, stamps=stamps, error=repr(e))


def metric(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("#") and line.split()[0].split("{")[0] in (name, name + "_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_config(args, name, env_extra):
    log_path = os.path.join(args.log_dir, f"bench_vllm_{name}.log")
    t_start = time.time()
    proc, url, log = start_server(args, name, env_extra, log_path)
    startup = time.time() - t_start
    try:
        rng = random.Random(args.seed)
        # Fixed-length prompts of random token ids (the same for every configuration).
        prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        gaps = [rng.expovariate(args.rate) for _ in range(args.requests)]
        results = [dict() for _ in range(args.requests)]
        threads = []
        t0 = time.perf_counter()
        for i in range(args.requests):
            time.sleep(gaps[i])
            th = threading.Thread(
                target=one_request,
                args=(url, args.model, prompts[i], args.output_len, args.request_timeout, results[i]),
                daemon=True,
            )
            th.start()
            threads.append(th)
        for th in threads:
            th.join(timeout=max(1.0, args.request_timeout - (time.perf_counter() - t0)))
        wall = time.perf_counter() - t0
        preemptions = metric(url, "vllm:num_preemptions")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    text = open(log_path).read()
    m = re.search(
        r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text
    )
    kv_tokens = int(m.group(1).replace(",", "")) if m else None
    ok = [r for r in results if r.get("ok")]
    ttft = [r["stamps"][0] - r["start"] for r in ok if r["stamps"]]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    latency = [r["stamps"][-1] - r["start"] for r in ok if r["stamps"]]  # arrival to last token
    out_tokens = sum(len(r["stamps"]) for r in ok)
    return {
        "config": name,
        "settings": env_extra or {},
        "requests": args.requests,
        "completed": len(ok),
        "failed": args.requests - len(ok),
        "wall_s": wall,
        "server_startup_s": startup,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "itl_p50_s": percentile(itl, 0.5),
        "itl_p95_s": percentile(itl, 0.95),
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p95_s": percentile(latency, 0.95),
        "kv_budget_bytes": args.kv_mib << 20,
        "kv_cache_tokens": kv_tokens,
        "kv_bytes_per_token": (args.kv_mib << 20) / kv_tokens if kv_tokens else None,
        "max_concurrent_seqs": (kv_tokens // (args.prompt_len + args.output_len)) if kv_tokens else None,
        "preemptions": preemptions,
        "log": log_path,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "build", "smollm2-hf"))
    p.add_argument("--launcher", default=os.path.join(os.path.dirname(sys.executable), "vllm-nexuskv"))
    p.add_argument("--configs", default="stock,nexuskv-4bit,nexuskv-2bit")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-mib", type=int, default=64, help="KV cache budget of every configuration, MiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="tokens per engine step (vLLM's chunked-prefill budget; 0: vLLM's default): a step that "
        "holds a long prefill chunk delays every running sequence's next token",
    )
    p.add_argument("--compile", action="store_true", help="let vLLM compile the model (slower start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_vllm.json"))
    args = p.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    load_before = os.getloadavg()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for name in args.configs.split(","):
        print(f"== {name}", flush=True)
        rows.append(run_config(args, name, CONFIGS[name]))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    load_after = os.getloadavg()
    stock = next((r for r in rows if r["config"] == "stock"), None)
    for r in rows:
        r["requests_per_s_vs_stock"] = r["requests_per_s"] / stock["requests_per_s"] if stock else None
    with open(args.out, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "date": date,
                "loadavg_before": load_before,
                "loadavg_after": load_after,
                "results": rows,
            },
            f,
            indent=2,
        )
    head = (
        "config",
        "done",
        "req/s",
        "vs stock",
        "tok/s",
        "TTFT p50",
        "TTFT p95",
        "ITL p50",
        "ITL p95",
        "latency p50",
        "latency p95",
        "KV B/tok",
        "max seqs",
        "preempt",
    )
    print("\n" + " | ".join(head))
    for r in rows:
        print(
            " | ".join(
                [
                    r["config"],
                    f"{r['completed']}/{r['requests']}",
                    f"{r['requests_per_s']:.3f}",
                    f"{r['requests_per_s_vs_stock']:.2f}x" if r["requests_per_s_vs_stock"] else "-",
                    f"{r['output_tokens_per_s']:.1f}",
                    f"{r['ttft_p50_s']:.2f}",
                    f"{r['ttft_p95_s']:.2f}",
                    f"{r['itl_p50_s'] * 1e3:.0f} ms",
                    f"{r['itl_p95_s'] * 1e3:.0f} ms",
                    f"{r['latency_p50_s']:.2f}",
                    f"{r['latency_p95_s']:.2f}",
                    f"{r['kv_bytes_per_token']:.0f}" if r["kv_bytes_per_token"] else "?",
                    str(r["max_concurrent_seqs"]),
                    f"{r['preemptions']:.0f}",
                ]
            )
        )
    print(f"\n{date}, load average before {load_before[0]:.2f} / after {load_after[0]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
