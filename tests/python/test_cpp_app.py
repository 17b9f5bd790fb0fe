"""The LibTorch example app (examples/cpp/decode.cpp): a TorchScript decoder
module saved from Python runs in C++ over a nexuskv cache built there, and
must reproduce the outputs Python computed step by step."""

import os
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import torch

import nexuskv  # loads the library (torch.classes.nexuskv) and has the cache factory

APP = Path(os.environ.get("NEXUSKV_DECODE_APP", Path(__file__).resolve().parents[2] / "build" / "py" / "examples" / "cpp" / "nexuskv_decode"))


class Decoder(torch.nn.Module):
    """Append this step's K/V to the cache, attend with this step's queries."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.classes.nexuskv.KVCache):
        cache.append(k, v, None)
        return cache.attend(q, None)


class Data(torch.nn.Module):
    def __init__(self, **tensors):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)


def run_decode_app(app: Path, tmp_path: Path, nexuskv_lib_dir: Optional[Path] = None) -> str:
    """Saves a scripted decoder and its inputs/expected outputs from Python, runs the app on
    them (libnexuskv from nexuskv_lib_dir, default the Python package's), and returns its
    output (it exits non-zero on a mismatch)."""
    torch.manual_seed(0)
    steps, B, H, D = 12, 2, 2, 64
    # A prefill of 40 tokens, then single-token decode steps.
    q = torch.randn(steps, B, 2 * H, 1, D)
    k = torch.randn(steps, B, H, 1, D)
    v = torch.randn(steps, B, H, 1, D)
    prefill = (torch.randn(B, H, 40, D), torch.randn(B, H, 40, D))
    cache = nexuskv.cache.make_cache(key_group_size=32, value_group_size=32, residual=16)
    cache.append(*prefill, None)
    decoder = torch.jit.script(Decoder())
    expected = torch.stack([decoder(q[i], k[i], v[i], cache) for i in range(steps)])
    torch.jit.save(decoder, str(tmp_path / "decoder.pt"))
    ref = torch.jit.script(Data(q=q, k=k, v=v, expected=expected, prefill_k=prefill[0], prefill_v=prefill[1]))
    torch.jit.save(ref, str(tmp_path / "data.pt"))
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        [str(nexuskv_lib_dir or Path(nexuskv.__file__).parent), str(Path(torch.__file__).parent / "lib"),
         os.environ.get("LD_LIBRARY_PATH", "")]))
    run = subprocess.run([str(app), str(tmp_path / "decoder.pt"), str(tmp_path / "data.pt")], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK" in run.stdout
    return run.stdout


@pytest.mark.skipif(not APP.exists(), reason=f"{APP} not built (needs NEXUSKV_BUILD_TESTS=ON)")
def test_cpp_app_reproduces_python(tmp_path):
    run_decode_app(APP, tmp_path)
