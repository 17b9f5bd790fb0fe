"""from_state_dict against forged or inconsistent states (outside review, round 3): each was
accepted, and then gave wrong output, failed at a later attend(), or overflowed int64 (UBSan).
Every one is now rejected at load, with the entry at fault named."""

import pytest
import torch
from test_cache_factory import feed

from nexuskv.cache import from_state_dict, make_cache

DGQ = dict(key_bits=4, key_dynamic=True, key_group_size=32, value_group_size=32, residual=8)


def state_of(prefill=70, **kw):
    cache = make_cache(**kw)
    feed(cache, 2, 5, prefill=prefill)
    assert int(cache.compressed_lengths().max()) > 0
    return cache.state_dict()


def rejected(state, *words):
    with pytest.raises(RuntimeError, match="KVCache.from_state_dict: ") as info:
        from_state_dict(state)
    message = str(info.value).split("\n")[0]
    for w in words:
        assert w in message, (w, message)


def with_starts(good, edit):
    s = good["keys.segment_starts"].clone()
    edit(s)
    return {**good, "keys.segment_starts": s}


def test_dgq_segment_starts_must_match_config_dynamic():
    good = state_of(**DGQ)
    # key_dynamic = 0 with segment starts: they would be ignored and every key group read wrong.
    rejected({**good, "config.key_dynamic": torch.tensor(0)}, "keys.segment_starts", "config.key_dynamic = 0")
    missing = {k: v for k, v in good.items() if k != "keys.segment_starts"}
    rejected(missing, "keys.segment_starts")
    from_state_dict(good)


def test_forged_segment_starts_are_rejected_at_load_with_the_entry_named():
    good = state_of(prefill=200, **DGQ)
    starts = good["keys.segment_starts"]
    c = int(good["lengths.compressed"][0])
    assert c >= 64 and starts.shape[2] >= 3
    cases = {
        "off the granule": lambda s: s[0, 0, 1].fill_(int(s[0, 0, 1]) + 3),
        "all zero": lambda s: s.zero_(),
        "longer than max_len": lambda s: s[0, 0, 1:].fill_(c),  # one segment over all c >= 64 + 32 tokens
        "not ordered": lambda s: s[0, 1, 1].fill_(int(s[0, 1, 2]) + 16),
        "past the compressed length": lambda s: s[0, 0, -1].fill_(c + 16),
        "not from 0": lambda s: s[0, 0, 0].fill_(16),
    }
    for what, edit in cases.items():
        forged = with_starts(good, edit)
        if torch.equal(forged["keys.segment_starts"], starts):
            continue  # (an edit that happens to change nothing for this data)
        rejected(forged, "keys.segment_starts")


def test_a_corrupt_stored_segment_starts_fails_at_load_not_at_the_next_attend():
    good = state_of(**DGQ)
    # Before: only order and bounds were checked, so this loaded and every attend() raised.
    forged = with_starts(good, lambda s: s[:, :, 1:].fill_(int(good["lengths.compressed"][0])))
    rejected(forged, "keys.segment_starts")


@pytest.mark.parametrize("value", [2**63 - 32, 2**62, -32])
def test_evicted_lengths_are_bounded(value):
    good = state_of(key_bits=2, key_group_size=16, value_group_size=16, residual=4, window=40)
    ev = good["lengths.evicted"].clone()
    ev[1] = value
    rejected({**good, "lengths.evicted": ev}, "lengths.evicted[1]")


def test_a_window_widened_over_evicted_tokens_is_rejected():
    good = state_of(key_bits=2, key_group_size=16, value_group_size=16, residual=4, window=40)
    assert int(good["lengths.evicted"].max()) > 0
    rejected({**good, "config.window": torch.tensor(4096)}, "lengths.evicted", "config.window = 4096")
    from_state_dict({**good, "config.window": torch.tensor(40)})


def external_state():
    cache = make_cache(external_chunk=16, residual=4)
    cache.append(torch.randn(2, 2, 60, 64), torch.randn(2, 2, 60, 64), None)
    st = cache.state_dict()
    assert st["due.seq"].numel() == 2
    return st


def test_external_due_chunks_are_checked():
    good = external_state()
    off = good["due.offset"].clone()
    off[0] = -16
    rejected({**good, "due.offset": off}, "due.offset[0]")
    off[0] = 8  # not a whole chunk
    rejected({**good, "due.offset": off}, "due.offset[0]")
    short = {**good, "due.k.0": good["due.k.0"][:, :5].clone(), "due.v.0": good["due.v.0"][:, :5].clone()}
    rejected(short, "due.k.0", "whole number of chunks of 16")
    rejected({**good, "due.seq": good["due.seq"][:1].clone()}, "due.seq", "due.offset")
    from_state_dict(good)


def test_lengths_beyond_their_buffers_name_the_entry():
    good = state_of(key_group_size=32, value_group_size=32, residual=16)
    tail = good["lengths.tail"].clone()
    tail[0] = 10**6
    rejected({**good, "lengths.tail": tail}, "lengths.tail[0]")
    comp = good["lengths.compressed"].clone()
    comp[2] = 10**6 * 32
    rejected({**good, "lengths.compressed": comp}, "lengths.compressed[2]")


def test_a_restored_window_cache_keeps_evicting_without_overflow():
    # The UBSan finding's path, with a legal state: append and crop after a restore.
    cache = make_cache(key_bits=2, key_group_size=16, value_group_size=16, residual=4, window=40)
    feed(cache, 2, 5)
    restored = from_state_dict(cache.state_dict())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        k, v = torch.randn(3, 2, 50, 64, generator=g), torch.randn(3, 2, 50, 64, generator=g)
        cache.append(k, v, None)
        restored.append(k, v, None)
    q = torch.randn(3, 4, 1, 64, generator=g)
    assert torch.equal(cache.attend(q, None, None), restored.attend(q, None, None))
    positions = int((restored.lengths() + restored.evicted_lengths()).max())
    restored.crop(positions - 3)


@pytest.mark.parametrize("kw", [dict(), DGQ, dict(key_outliers=1, value_outliers=1, residual=0, sinks=2)])
def test_a_cache_with_nothing_compressed_yet_restores(kw):
    # The per-entry checks at load skip sequences with no compressed tokens (nothing to decode).
    cache = make_cache(**kw)
    cache.append(torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), None)
    restored = from_state_dict(cache.state_dict())
    q = torch.randn(2, 4, 1, 64)
    assert torch.equal(restored.attend(q, None, None), cache.attend(q, None, None))
