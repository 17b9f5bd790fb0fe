"""benchmarks/bench_cpu_decode.py counts the inner loops of the integer attention kernels in
objdump's disassembly: the smallest backward-jump range holding every dot product (vpdpbusd in
the AVX-512 kernels, vpmaddwd in the AVX2 ones).  Checked on a hand-written listing (an outer
loop around it, a deliberately longer loop counts more) and on the installed library: every
variant found, each loop holding the dot products its template arguments say (AVX-512 p.V:
planes per pass x rows x limbs, q.K: planes x rows x limbs; AVX2 q.K: planes x rows x limbs,
p.V: two 8-channel halves x rows x limbs)."""

import importlib.util
import os
import platform
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "bench_cpu_decode", os.path.join(ROOT, "benchmarks", "bench_cpu_decode.py")
)
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_cpu_decode"] = bench
spec.loader.exec_module(bench)


def body(extra=0):
    """(address, text) of a function: set-up, an outer loop, the token loop, the tail."""
    ins = ["mov %rdi,%rax", "vpxord %zmm0,%zmm0,%zmm0"]  # 0, 1
    ins += ["add $0x10,%rax"]  # 2: outer loop head
    ins += ["vmovdqu (%rax),%xmm1"]  # 3: token loop head
    ins += ["vpdpbusd (%rcx){1to16},%zmm1,%zmm0"] * 2 + ["add $0x4,%rsi"] * extra
    ins += ["cmp %rsi,%rdx", "jg 3"]  # back edge of the token loop
    ins += ["vcvtdq2ps %zmm0,%zmm2", "cmp %r8,%r9", "jg 2", "ret"]  # outer back edge, exit
    out = []
    for i, text in enumerate(ins):
        if text.startswith("jg "):
            text = "jg    %x <f+0x%x>" % (int(text.split()[1]), int(text.split()[1]))
        out.append((i, text))
    return out


def test_the_token_loop_is_the_smallest_loop_around_the_dot_products():
    count, dots = bench.token_loop(body())
    assert (count, dots) == (5, 2)  # head, two vpdpbusd, cmp, jg: not the outer loop
    slower, _ = bench.token_loop(body(extra=3))
    assert slower == count + 3  # more work in the loop counts more


def test_the_innermost_loop_of_several():
    # Two token loops in one function (the AVX2 p.V kernel's planes): every=False takes the
    # smallest loop holding any dot product, with its own dot products.
    twice = body() + [(100 + a, t.replace("jg    3", "jg    67").replace("<f+0x3>", "<f+0x67>")) for a, t in body()]
    assert bench.token_loop(twice, every=False) == (5, 2)
    assert bench.token_loop(twice)[1] == 4  # (every dot product: the loop around both)


def test_no_dot_products_means_no_loop():
    assert bench.token_loop([(0, "mov %rdi,%rax"), (1, "jmp    0 <f>")]) is None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX-512 kernels are x86 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_every_avx512_variant_is_found_in_the_library():
    counts = [c for c in bench.loop_counts(bench.library_path()) if c["isa"] == "avx512"]
    planes = {2: 4, 4: 2, 8: 1}
    seen = set()
    for c in counts:
        rows_limbs = c["query_rows"] * c["limbs"]
        if c["loop"].startswith("p.V"):
            per_pass = c["dots"] // rows_limbs
            assert c["dots"] == per_pass * rows_limbs and planes[c["bits"]] % per_pass == 0, c
            assert per_pass * rows_limbs <= 24, c  # the accumulators fit the 32 zmm registers
        else:
            assert c["dots"] == planes[c["bits"]] * rows_limbs, c
        assert c["loop_instructions"] > c["dots"], c
        seen.add((c["loop"][:3], c["bits"], c["query_rows"], c["limbs"]))
    for kind in ("p.V", "q.K"):
        for bits in (2, 4, 8):
            for limbs in (2, 3):
                assert (kind, bits, 4, limbs) in seen, (kind, bits, limbs)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 kernels are x86 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_every_avx2_variant_is_found_in_the_library():
    counts = [c for c in bench.loop_counts(bench.library_path()) if c["isa"] == "avx2"]
    planes = {2: 4, 4: 2, 8: 1}
    seen = set()
    for c in counts:
        assert c["dot_instruction"] == "vpmaddwd", c
        rows_limbs = c["query_rows"] * c["limbs"]
        if c["loop"].startswith("p.V"):
            assert c["dots"] == 2 * rows_limbs and rows_limbs <= 4, c  # one plane of two tokens
        else:
            assert c["dots"] == planes[c["bits"]] * rows_limbs, c
        assert c["loop_instructions"] > c["dots"], c
        seen.add((c["loop"][:3], c["bits"], c["query_rows"], c["limbs"]))
    for bits in (2, 4, 8):
        for rows in (1, 2, 3, 4):
            for limbs in (1, 2):
                assert ("q.K", bits, rows, limbs) in seen, (bits, rows, limbs)
                if rows * limbs <= 4:
                    assert ("p.V", bits, rows, limbs) in seen, (bits, rows, limbs)
