"""The bad-input sweep's own machinery (scripts/bad_input_sweep.py): the "clear" rule (a
message must name the argument at fault), the hints every case lists, the verdicts, and a
fast subset run as the sweep runs it (each case in a forked process).  The product's
verdicts are the sweep's business, not this test's: the subset is cases whose outcome does
not depend on the open fixes of issue 18 (valid NQ sequences, clear errors), plus one case
of each new group run only for a verdict from the vocabulary (no crash, no hang)."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("bad_input_sweep", ROOT / "scripts" / "bad_input_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    module.build_cases()
    return module


def test_a_message_must_name_the_argument_as_a_whole_name(sweep):
    names = sweep.names_argument
    assert names("kvcache: k holds nan", "k")
    assert not names("kvcache: k_tail must be float", "k")  # part of a longer name
    assert not names("entry 'tail.k' holds nan", "k")  # part of a dotted entry name
    assert names("entry 'keys.segment_starts' must ...", "keys.segment_starts")
    assert not names("segment_starts must list ordered segments", "keys.segment_starts")
    assert not names("keys.segment_starts.x", "keys.segment_starts")
    assert names("rotation signs must have shape [64]", "rotation_signs")  # "_" written as a space
    assert names("attend() before any append()", "attend()")
    assert names("the state has no entry 'shape'", "'shape'")
    assert not names("q must have shape [2, 4, 1, 64]", "'shape'")


def test_every_case_lists_argument_names_not_generic_words(sweep):
    bad = [c for c in sweep.CASES if c.category != "valid"]
    assert bad and all(c.hints for c in bad)
    for word in ("must", "expected", "shape", "finite", "nan"):
        with pytest.raises(ValueError, match="not the name of an argument"):
            sweep._check_hints("case", (word,))
    assert {c.group for c in sweep.CASES} == set(sweep.GROUPS)


def test_verdicts(sweep):
    case = sweep.Case("t/x", "t", "args", lambda: None, ("value_bits",))
    raised = dict(status="raised", clear_type=True)
    assert sweep.verdict(case, {**raised, "msg": "StaticKVCache: value_bits must be 2, 3, 4 or 8"}) == "clear"
    assert sweep.verdict(case, {**raised, "msg": "nq_compress: bits must be one of 2, 3, 4, 8"}) == "unclear"
    assert sweep.verdict(case, {**raised, "msg": "value_bits", "clear_type": False}) == "unclear"
    assert sweep.verdict(case, {"status": "returned", "what": "None"}) == "silent"
    assert sweep.verdict(case, {"status": "crash", "signal": "SIGSEGV"}) == "crash"
    ok = sweep.Case("t/v", "t", "valid", lambda: None)
    assert sweep.verdict(ok, {"status": "checked", "err": 0.5, "tol": 1.0}) == "pass"
    assert sweep.verdict(ok, {"status": "checked", "err": 2.0, "tol": 1.0}) == "wrong"
    assert sweep.verdict(ok, {"status": "raised", "msg": "x"}) == "error"


def _run(sweep, name):
    (case,) = [c for c in sweep.CASES if c.name == name]
    return sweep.verdict(case, sweep.run_isolated(case, 120.0))


@pytest.mark.parametrize(
    "name, want",
    [
        ("KVCache sequence/nq G32 r16 2x seeds 0-5", "pass"),
        ("KVCache sequence/nq G32 r5 window48 2x seeds 0-5", "pass"),
        ("StaticKVCache sequence/nq G32 r16 seeds 0-3", "pass"),
        ("peaked softmax/dgq_fused_attention q float32 (bf16 values)", "pass"),
        ("nq_compress/bits 5", "clear"),
        ("KVCache.from_state_dict/missing lengths.tail", "clear"),
    ],
)
def test_fast_subset(sweep, name, want):
    assert _run(sweep, name) == want


@pytest.mark.parametrize(
    "name",
    [
        "KVCache sequence/review item 2: DGQ crop(35) of 70, seeds 0-39",
        "KVCache.from_state_dict/forged: due.offset negative",
        "static_cache/constructor value_bits 5",
    ],
)
def test_new_groups_run(sweep, name):
    """Open issue-18 items: whatever today's verdict, one of the vocabulary, in a forked process."""
    assert _run(sweep, name) in sweep.BAD_VERDICTS + sweep.VALID_VERDICTS
