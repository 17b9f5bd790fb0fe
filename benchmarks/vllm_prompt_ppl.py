"""Prompt perplexity through vLLM's CPU engine: the stock bf16 KV cache against nexuskv's
compressed pages under several settings and rotation seeds, side by side in one run.

Each engine runs in a process of its own (tests/python/vllm_engine.py, the tests' runner),
offline, eager, bf16: the first --tokens tokens of Debian's reference manual (BOS first) go
in as one prompt and vLLM's `prompt_logprobs` give the log-probability of every token after
the first, each position attending over the compressed pages (its own prompt's tokens
included).  A recipe (`--recipe`, or one calibrated here on --calib-text with `python -m
nexuskv calibrate`) centers the keys where a configuration says so.  Prints a table (change
against stock in %, per seed and mean) and writes JSON.

    build/venv-vllm/bin/python benchmarks/vllm_prompt_ppl.py --seeds 0 1 2 \\
        --configs 4bit,4bit-recipe,4bit-recipe-fit-keys --out benchmarks/vllm_prompt_ppl.json

A single engine run's 4-bit perplexity moves by points with the rotation seed (a 1-ulp
difference in one layer flips codes in the next ones: docs/vllm.md), hence the seeds."""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "tests", "python", "vllm_engine.py")
POEMS = "/usr/share/games/fortunes/songs-poems"
BITS4 = {"NEXUSKV_VLLM_KEY_BITS": "4", "NEXUSKV_VLLM_VALUE_BITS": "4"}
# name -> (environment of the backend, whether it reads the recipe); None: stock CPU_ATTN
CONFIGS = {  # every one names its fit and its exact window: the backend's defaults changed over time
    "4bit": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="none", NEXUSKV_VLLM_EXACT_WINDOW="0"), False),
    "4bit-fit-keys": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="keys", NEXUSKV_VLLM_EXACT_WINDOW="0"), False),
    "4bit-recipe": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="none", NEXUSKV_VLLM_EXACT_WINDOW="0"), True),
    "4bit-recipe-fit-keys": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="keys", NEXUSKV_VLLM_EXACT_WINDOW="0"), True),
    "4bit-recipe-fit-all": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="all", NEXUSKV_VLLM_EXACT_WINDOW="0"), True),
    "4bit-g32-recipe-fit-all": (
        dict(BITS4, NEXUSKV_VLLM_GROUP_SIZE="32", NEXUSKV_VLLM_FIT_RANGE="all", NEXUSKV_VLLM_EXACT_WINDOW="0"),
        True,
    ),
    # an exact window of W tokens: 88 bytes per slot at W = 8 (vLLM's CPU blocks of 128), 80 at 4, 104 at 16
    "4bit-recipe-fit-keys-w4": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="keys", NEXUSKV_VLLM_EXACT_WINDOW="4"), True),
    "4bit-recipe-fit-keys-w8": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="keys", NEXUSKV_VLLM_EXACT_WINDOW="8"), True),
    "4bit-recipe-fit-keys-w16": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="keys", NEXUSKV_VLLM_EXACT_WINDOW="16"), True),
    "4bit-w8": (dict(BITS4, NEXUSKV_VLLM_FIT_RANGE="none", NEXUSKV_VLLM_EXACT_WINDOW="8"), False),
    "8bit-keys-4bit-values": (
        {
            "NEXUSKV_VLLM_KEY_BITS": "8",
            "NEXUSKV_VLLM_VALUE_BITS": "4",
            "NEXUSKV_VLLM_FIT_RANGE": "none",
            "NEXUSKV_VLLM_EXACT_WINDOW": "0",
        },
        False,
    ),
}


def engine_env(extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXUSKV_VLLM_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def run_engine(job: dict, env_extra: dict, tmp: str, name: str, timeout: float) -> dict:
    out, log = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.log")
    with open(log, "w") as f:
        p = subprocess.run(
            [sys.executable, ENGINE, out],
            input=json.dumps(job),
            text=True,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=engine_env(env_extra),
            timeout=timeout,
        )
    if p.returncode != 0:
        sys.exit(f"vllm_prompt_ppl: engine {name} failed ({p.returncode}); its log: {log}\n" + open(log).read()[-3000:])
    return json.load(open(out))


def text_ids(model: str, tokens: int) -> list:
    from transformers import AutoTokenizer

    from nexuskv.models import load_text

    ids = AutoTokenizer.from_pretrained(model)(load_text()[: 16 * tokens]).input_ids[:tokens]
    if len(ids) < tokens:
        sys.exit(f"vllm_prompt_ppl: the text gives {len(ids)} tokens, fewer than --tokens {tokens}")
    return ids


def calibrate(model: str, text: str, out: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "nexuskv", "calibrate", "--model", model, "--text", text, "--out", out],
        capture_output=True,
        text=True,
        env=engine_env({}),
        timeout=1800,
    )
    if p.returncode != 0:
        sys.exit(f"vllm_prompt_ppl: calibrate failed:\n{p.stderr[-3000:]}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "build", "smollm2-hf"), help="a Hugging Face model dir")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, among {', '.join(CONFIGS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="rotation seeds of each configuration")
    p.add_argument("--tokens", type=int, default=1024, help="prompt tokens (the manual's first, BOS first)")
    p.add_argument("--recipe", default="", help="a recipe file (calibrate); default: calibrated here on --calib-text")
    p.add_argument("--calib-text", default=POEMS, help="text the recipe is calibrated on (not the manual)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per engine")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "vllm_prompt_ppl.json"))
    a = p.parse_args(argv)
    names = [c for c in a.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            p.error(f"--configs: unknown configuration {c!r} (known: {', '.join(CONFIGS)})")
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        p.error(f"--model {a.model}: not a Hugging Face model directory (bash scripts/install_vllm.sh makes one)")
    load = os.getloadavg()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        recipe = a.recipe
        if not recipe and any(CONFIGS[c][1] for c in names):
            recipe = calibrate(a.model, a.calib_text, os.path.join(tmp, "recipe.safetensors"))
        ids = text_ids(a.model, a.tokens)
        job = {"model": a.model, "ppl": {"prompt_token_ids": ids}}
        stock = run_engine(dict(job, nexuskv=None), {}, tmp, "stock", a.timeout)["ppl"]["ppl"]
        rows = []
        for c in names:
            env, uses_recipe = CONFIGS[c]
            per_seed = []
            for seed in a.seeds:
                extra = dict(env, NEXUSKV_VLLM_ROTATION_SEED=str(seed))
                if uses_recipe:
                    extra["NEXUSKV_VLLM_RECIPE"] = recipe
                ppl = run_engine(dict(job, nexuskv=extra), extra, tmp, f"{c}-{seed}", a.timeout)["ppl"]["ppl"]
                per_seed.append(ppl)
                print(f"{c} seed {seed}: {ppl:.4f} ({100 * (ppl / stock - 1):+.2f} %)", flush=True)
            changes = [100 * (x / stock - 1) for x in per_seed]
            rows.append(
                dict(
                    config=c,
                    env=env,
                    recipe=bool(uses_recipe),
                    seeds=a.seeds,
                    ppl=per_seed,
                    change_pct=changes,
                    mean_change_pct=sum(changes) / len(changes),
                )
            )
    print(f"\nstock CPU_ATTN bf16: {stock:.4f} over {a.tokens} tokens of the manual")
    print("| config | " + " | ".join(f"seed {s}" for s in a.seeds) + " | mean |")
    print("|---|" + "---|" * (len(a.seeds) + 1))
    for r in rows:
        print(
            f"| {r['config']} | "
            + " | ".join(f"{x:+.2f} %" for x in r["change_pct"])
            + f" | {r['mean_change_pct']:+.2f} % |"
        )
    from nexuskv.profiling import machine_info

    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(
        started=(now - datetime.timedelta(seconds=time.time() - t0)).isoformat(timespec="seconds"),
        finished=now.isoformat(timespec="seconds"),
        machine=machine_info(os.cpu_count())["cpu_model"],
        cpus=os.cpu_count(),
        load_before=load,
        load_after=os.getloadavg(),
        seconds=round(time.time() - t0, 1),
        model=a.model,
        tokens=a.tokens,
        calib_text=None if a.recipe else a.calib_text,
        stock_ppl=stock,
        rows=rows,
    )
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
