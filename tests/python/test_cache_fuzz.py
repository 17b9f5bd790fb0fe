"""Randomized KVCache sessions (hypothesis): a random configuration (bits, group sizes and
axes, outliers, DGQ keys, rotation, sinks or a sliding window, residual, meta dtype, K/V
dtype, head_dim, GQA) and a random sequence of operations on it (ragged appends with left
padding, crop, reorder, a torch.save / torch.load round trip of the state dict, clone),
each checked against what it must equal:

  * lengths() + evicted_lengths() are the positions appended (minus those cropped);
  * the newest tokens of an append are in the tail exactly, the sinks too;
  * attend() equals float64 attention over the cache's own dense() view (causal, window,
    soft-cap), for queries of the newest positions;
  * crop keeps the first positions of dense(); reorder permutes dense() and the lengths;
  * a restored or cloned cache equals the original bit for bit, and keeps doing so after
    the same appends.

Part of the normal test run, and the cache part of the sanitizer job's fuzz subset
(scripts/sanitize.sh), where every one of these calls runs under ASan + UBSan."""

import io

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cache import attention_f64

from nexuskv.cache import from_state_dict, make_cache

DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.float16]


@st.composite
def session(draw):
    D = draw(st.sampled_from([16, 32, 48, 64]))
    k_group = draw(st.sampled_from([8, 16, 24, 32]))
    v_group = draw(st.sampled_from([8, 16, 32]))
    window = draw(st.sampled_from([None, None, None, 5, 40]))
    config = dict(
        key_bits=draw(st.sampled_from([2, 3, 4, 8])),
        key_group_size=k_group,
        key_axis=draw(st.sampled_from([-2, -2, -1])),
        key_outliers=draw(st.integers(0, 2)),
        value_bits=draw(st.sampled_from([2, 3, 4, 8])),
        value_group_size=v_group,
        value_axis=draw(st.sampled_from([-1, -1, -2])),
        value_outliers=draw(st.integers(0, 2)),
        residual=draw(st.sampled_from([0, 4, 16])),
        sinks=0 if window else draw(st.sampled_from([0, 0, 3])),
        rotate=draw(st.booleans()) and D & (D - 1) == 0,
        seed=draw(st.integers(0, 1000)),
        meta_dtype=draw(st.sampled_from([None, None, torch.float16, torch.bfloat16])),
        window=window,
    )
    config["key_dynamic"] = draw(st.booleans()) and config["key_axis"] == -2 and k_group >= 16
    dtype = draw(st.sampled_from(DTYPES))
    shape = dict(B=draw(st.integers(1, 3)), H=draw(st.integers(1, 2)), ratio=draw(st.sampled_from([1, 2])), D=D)
    ops = draw(
        st.lists(
            st.sampled_from(["append", "step", "step", "crop", "reorder", "save", "clone"]), min_size=2, max_size=6
        )
    )
    softcap = draw(st.sampled_from([None, None, 5.0]))
    return config, dtype, shape, ops, softcap, draw(st.integers(0, 2**16))


class Session:
    def __init__(self, config, dtype, shape, softcap, seed):
        self.cache = make_cache(**config)
        self.dtype, self.softcap, self.window = dtype, softcap, config["window"]
        self.sinks = config["sinks"]
        self.B, self.H, self.ratio, self.D = shape["B"], shape["H"], shape["ratio"], shape["D"]
        self.g = torch.Generator().manual_seed(seed)
        self.positions = [0] * self.B  # appended minus cropped, per sequence

    def randn(self, *size):
        return torch.randn(*size, generator=self.g).to(self.dtype)

    def kv(self, n):
        return self.randn(self.B, self.H, n, self.D), self.randn(self.B, self.H, n, self.D)

    def append(self, n, pad):
        k, v = self.kv(n)
        valid = torch.ones(self.B, n, dtype=torch.bool)
        for b in range(self.B):  # left padding, the last token valid
            valid[b, : min(int(torch.randint(0, pad + 1, (1,), generator=self.g)), n - 1)] = False
        self.cache.append(k, v, valid)
        for b in range(self.B):
            self.positions[b] += int(valid[b].sum())
        self.check_lengths()
        # The newest tokens of this append are in the tail exactly (at least residual, or the sinks).
        K, V, lens = self.cache.dense(None)
        comp = self.cache.compressed_lengths()
        for b in range(self.B):
            c = int(valid[b].sum())
            L = int(lens[b])
            exact = min(c, L - int(comp[b]) - min(self.sinks, L))  # the tail holds them
            if exact > 0:
                assert torch.equal(K[b, :, L - exact : L], k[b, :, n - exact :]), b
                assert torch.equal(V[b, :, L - exact : L], v[b, :, n - exact :]), b
            s = min(self.sinks, L)
            if s and self.positions[b] == c:  # first tokens of this sequence: the sinks, exact
                first = valid[b].nonzero()[0, 0]
                assert torch.equal(K[b, :, :s], k[b, :, first : first + s]), b
        return k, v, valid

    def check_lengths(self):
        lens, evicted = self.cache.lengths(), self.cache.evicted_lengths()
        assert (lens + evicted).tolist() == self.positions
        assert self.cache.used_nbytes() <= self.cache.nbytes()

    def attend(self, q_len):
        q = self.randn(self.B, self.H * self.ratio, q_len, self.D)
        out = self.cache.attend(q, None, self.softcap)
        K, V, lens = self.cache.dense(torch.float32)
        ref = attention_f64(q, K, V, lens, self.D**-0.5, window=self.window, softcap=self.softcap)
        assert out.dtype == self.dtype and out.shape == q.shape
        if self.dtype == torch.float32:
            assert float((out.double() - ref).norm() / ref.norm()) < 1e-4
        else:  # the output's rounding to 16 bits and the queries' integer limbs (bf16)
            assert float((out.double() - ref).abs().max()) < 2e-2
        return q, out


def same_cache(a, b):
    for x, y in zip(a.dense(None), b.dense(None)):
        assert torch.equal(x, y)
    assert torch.equal(a.evicted_lengths(), b.evicted_lengths())
    assert torch.equal(a.compressed_lengths(), b.compressed_lengths())
    assert a.nbytes() == b.nbytes() and a.used_nbytes() == b.used_nbytes()


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(session())
def test_random_cache_sessions(case):
    config, dtype, shape, ops, softcap, seed = case
    s = Session(config, dtype, shape, softcap, seed)
    s.append(int(torch.randint(1, 80, (1,), generator=s.g)), pad=8)
    s.attend(1)
    for op in ops:
        if op == "append":
            s.append(int(torch.randint(1, 40, (1,), generator=s.g)), pad=4)
            s.attend(min(3, *s.cache.lengths().tolist()))
        elif op == "step":  # one decode step
            s.append(1, pad=0)
            s.attend(1)
        elif op == "crop" and s.window is None:  # (crop with a window: test_cache_crop.py)
            length = int(torch.randint(1, max(s.positions) + 1, (1,), generator=s.g))
            K0, V0, _ = s.cache.dense(None)
            s.cache.crop(length)
            s.positions = [min(p, length) for p in s.positions]
            s.check_lengths()
            K, V, lens = s.cache.dense(None)
            for b in range(s.B):
                L = int(lens[b])
                if dtype == torch.float32:  # the survivors of a cut chunk: its dequantized values
                    assert torch.equal(K[b, :, :L], K0[b, :, :L]) and torch.equal(V[b, :, :L], V0[b, :, :L])
                else:  # (rounded to the cache's dtype once more)
                    torch.testing.assert_close(K[b, :, :L].float(), K0[b, :, :L].float(), rtol=2**-7, atol=1e-3)
                    torch.testing.assert_close(V[b, :, :L].float(), V0[b, :, :L].float(), rtol=2**-7, atol=1e-3)
            s.append(1, pad=0)
            s.attend(1)
        elif op == "reorder":
            beam = torch.randint(0, s.B, (s.B,), generator=s.g)
            K0, V0, lens0 = s.cache.dense(None)
            evicted0 = s.cache.evicted_lengths()
            s.cache.reorder(beam)
            s.positions = [s.positions[i] for i in beam.tolist()]
            s.check_lengths()
            K, V, lens = s.cache.dense(None)
            assert torch.equal(lens, lens0[beam]) and torch.equal(s.cache.evicted_lengths(), evicted0[beam])
            n = K.shape[2]
            assert torch.equal(K, K0[beam][:, :, :n]) and torch.equal(V, V0[beam][:, :, :n])
            s.attend(1)
        elif op == "save":  # torch.save / torch.load(weights_only=True) of the state dict
            buf = io.BytesIO()
            torch.save(s.cache.state_dict(), buf)
            buf.seek(0)
            restored = from_state_dict(torch.load(buf, weights_only=True))
            same_cache(s.cache, restored)
            k, v = s.kv(int(torch.randint(1, 20, (1,), generator=s.g)))
            q = s.randn(s.B, s.H * s.ratio, 1, s.D)
            for c in (s.cache, restored):  # both continue bit-exactly
                c.append(k, v, None)
            assert torch.equal(s.cache.attend(q, None, softcap), restored.attend(q, None, softcap))
            same_cache(s.cache, restored)
            s.cache = restored
            s.positions = [p + k.shape[2] for p in s.positions]
            s.check_lengths()
        elif op == "clone":
            twin = s.cache.clone()
            same_cache(s.cache, twin)
            lens = twin.lengths()
            s.append(2, pad=1)  # the clone is independent
            assert torch.equal(twin.lengths(), lens)
            s.cache = twin
            s.positions = (twin.lengths() + twin.evicted_lengths()).tolist()
            s.attend(1)
