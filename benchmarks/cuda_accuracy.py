"""How far apart the two CUDA attention kernels are, element by element, and how far each is from
float64 (needs a GPU; the numbers behind the tolerances of tests/python/test_cuda_attention.py).

For every case of the CUDA attention tests that the tensor-core kernel takes (the 2/4/8-bit grid
of test_attention.py, sinks, windows, head dims 64/128, unaligned key groups, long split
contexts; bf16 and fp16), the reference SIMT kernel (NEXUSKV_CUDA_ATTENTION=simple) once and
the tensor-core kernel (=mma) twice, and the decode kernel (=decode) where it takes the case
(with the decode kernel's grids of test_cuda_attention.py; its keys per token, which the
tensor-core kernel does not take, have the decode and simple statistics alone).  Per case, in units of the element's
magnitude mag = sum_j p_j rms(v_j) (Case.reference(value_magnitudes=True)):

  gap            max (|simple - mma| - one unit in the last place of the output) / mag
                 (what the test bounds by MMA_GAP)
  ulps           max |simple - mma| in units of eps x the larger of the two (near-zero
                 elements make this large: the reason the test bounds by mag, not by ulps)
  frac           fraction of elements where the two kernels' outputs differ
  f32gap_simple  max (|simple - f64| - half an ulp of the output) / mag: the arithmetic error
  f32gap_mma     the same for the tensor-core kernel
  rr_row         max (|mma run 1 - run 2| - one ulp) / the row's largest output (RERUN_GAP)
  f32gap_decode  f32gap for the decode kernel (its queries x key scales rounded to 16-bit
                 integers: coarser than the tensor-core kernel's 22 bits)
  rel_decode     |decode - f64| / |f64| (Frobenius), against the tests' bound tolerance(dtype)
                 (the decode statistics only over the cases the decode kernel takes)

    python benchmarks/cuda_accuracy.py --json results/cuda_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))

STATS = (
    "gap",
    "ulps",
    "frac",
    "f32gap_simple",
    "f32gap_mma",
    "rr_row",
    "rr_frac",
    "rr_ulps",
    "f32gap_decode",
    "rel_decode",
)


def cases():
    from test_attention import GRID, SINK_GRID, Case, sink_case
    from test_cuda_attention import DECODE_GRID, MMA_BITS, TOKEN_KEYS_DECODE_GRID, decode_case, grid_case

    for dtype in (torch.bfloat16, torch.float16):
        for g in DECODE_GRID:
            yield f"decode{g}", lambda g=g, dtype=dtype: decode_case(*g, dtype=dtype)
        for g in TOKEN_KEYS_DECODE_GRID:
            yield f"decode_token_keys{g}", lambda g=g, dtype=dtype: decode_case(*g, dtype=dtype, token_keys=True)
        for g in GRID:
            if g[0] in MMA_BITS:
                yield f"grid{g}", lambda g=g, dtype=dtype: grid_case(*g, longest=200, dtype=dtype)
        for sg in SINK_GRID:
            yield f"sink{sg}", lambda sg=sg, dtype=dtype: sink_case(*sg, dtype)
        for w in (1, 5, 32, 33, 70, 500):
            yield (
                f"window{w}",
                lambda w=w, dtype=dtype: Case(
                    comp_lens=(130, 45), tail=12, tail_lens=[12, 3], q_len=4, sinks=3, window=w, dtype=dtype, seed=w
                ),
            )
        for d in (64, 128):
            yield (
                f"head{d}",
                lambda d=d, dtype=dtype: Case(head_dim=d, dtype=dtype, q_len=2, tail=8, rotate=True, seed=d),
            )
        for name, kw in (
            ("groups16", dict(group=16, v_group=16, comp_lens=(300, 70))),
            ("groups48", dict(group=48, v_group=48, comp_lens=(300, 70))),
            ("long", dict(comp_lens=(2000, 300), q_len=3)),
        ):
            yield name, lambda kw=kw, dtype=dtype: Case(dtype=dtype, seed=7, **kw)


def run(case, kernel: str) -> torch.Tensor:
    from test_cuda_attention import on_cuda

    os.environ["NEXUSKV_CUDA_ATTENTION"] = kernel
    return on_cuda(case).run().cpu().double()


def stats(case, name: str) -> dict:
    from test_cuda_attention import beyond_one_ulp, decode_takes, mma_takes, rel_err  # the tests' own measures

    ref, mag = case.reference(), case.reference(value_magnitudes=True).clamp_min(1e-300)
    eps = torch.finfo(case.q.dtype).eps
    s = run(case, "simple")
    m1, m2 = (run(case, "mma"), run(case, "mma")) if mma_takes(case) else (None, None)

    def ulps(a, b):
        return float(((a - b).abs() / (eps * torch.maximum(a.abs(), b.abs())).clamp_min(1e-300)).max())

    def f32gap(x):  # max (|x - f64| - half an ulp of the output) / mag
        return float((((x - ref).abs() - 0.5 * eps * ref.abs()).clamp_min(0) / mag).max())

    d = run(case, "decode") if decode_takes(case) else None
    mma = {}  # (the tensor-core kernel's statistics, where it takes the case)
    if m1 is not None:
        row = m1.abs().amax(-1, keepdim=True).clamp_min(1e-300)
        mma = dict(
            gap=float((beyond_one_ulp(s, m1, case.q.dtype) / mag).max()),
            ulps=ulps(s, m1),
            frac=float((s != m1).double().mean()),
            f32gap_mma=f32gap(m1),
            rr_row=float((beyond_one_ulp(m1, m2, case.q.dtype) / row).max()),
            rr_frac=float((m1 != m2).double().mean()),
            rr_ulps=ulps(m1, m2),
        )
    return dict(
        case=name,
        dtype=str(case.q.dtype).replace("torch.", ""),
        **{k: mma.get(k) for k in ("gap", "ulps", "frac")},
        f32gap_simple=f32gap(s),
        **{k: mma.get(k) for k in ("f32gap_mma", "rr_row", "rr_frac", "rr_ulps")},
        f32gap_decode=None if d is None else f32gap(d),
        rel_decode=None if d is None else float(rel_err(d, ref)),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="results/cuda_accuracy.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_accuracy: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from test_cuda_attention import MMA_GAP, RERUN_GAP, decode_takes, mma_takes, tolerance  # (imports nexuskv)

    t0 = time.time()
    rows = []
    for name, make in cases():
        case = make()
        if mma_takes(case) or decode_takes(case):
            rows.append(stats(case, name))
    print(f"{len(rows)} cases in {time.time() - t0:.0f} s on {torch.cuda.get_device_name(0)}")
    print(f"{'dtype':9} {'stat':14} {'max':>10} {'median':>10}  worst case")
    for dt in ("bfloat16", "float16"):
        r = [x for x in rows if x["dtype"] == dt]
        for k in STATS:
            had = [x for x in r if x[k] is not None]  # (each kernel's statistics: its cases only)
            if not had:
                continue
            worst = max(had, key=lambda x: x[k])
            print(f"{dt:9} {k:14} {worst[k]:10.3e} {sorted(x[k] for x in had)[len(had) // 2]:10.3e}  {worst['case']}")
    print(
        f"test bounds: gap <= MMA_GAP = {MMA_GAP:.3e}, rr_row <= RERUN_GAP = {RERUN_GAP:.3e}, "
        f"rel_decode <= tolerance(dtype) (bf16 {tolerance(torch.bfloat16):.3e}, fp16 {tolerance(torch.float16):.3e})"
    )
    print(f"decode kernel: {sum(x['rel_decode'] is not None for x in rows)} of the {len(rows)} cases")
    info = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(info=info, cases=rows), indent=0))
    print(f"wrote {path}")
    within = all(
        (x["gap"] is None or x["gap"] <= MMA_GAP)
        and (x["rr_row"] is None or x["rr_row"] <= RERUN_GAP)
        and (x["rel_decode"] is None or x["rel_decode"] <= tolerance(getattr(torch, x["dtype"])))
        for x in rows
    )
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
