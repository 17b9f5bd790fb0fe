"""The LibTorch example app (examples/cpp/decode.cpp): a TorchScript decoder
module saved from Python runs in C++ over a nexuskv cache built there, and
must reproduce the outputs Python computed step by step."""

import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import torch

import nexuskv  # loads the library (torch.classes.nexuskv) and has the cache factory

APP = Path(os.environ.get("NEXUSKV_DECODE_APP", Path(__file__).resolve().parents[2] / "build" / "py" / "examples" / "cpp" / "nexuskv_decode"))


ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_inputs", ROOT / "examples" / "cpp" / "make_inputs.py")
make_inputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_inputs)


def run_decode_app(app: Path, tmp_path: Path, nexuskv_lib_dir: Optional[Path] = None) -> str:
    """Saves a scripted decoder and its inputs/expected outputs from Python
    (examples/cpp/make_inputs.py), runs the app on
    them (libnexuskv from nexuskv_lib_dir, default the Python package's), and returns its
    output (it exits non-zero on a mismatch)."""
    decoder, data = make_inputs.write_inputs(tmp_path)  # the documented command's inputs
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        [str(nexuskv_lib_dir or Path(nexuskv.__file__).parent), str(Path(torch.__file__).parent / "lib"),
         os.environ.get("LD_LIBRARY_PATH", "")]))
    run = subprocess.run([str(app), str(decoder), str(data)], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK" in run.stdout
    return run.stdout


@pytest.mark.skipif(not APP.exists(), reason=f"{APP} not built (needs NEXUSKV_BUILD_TESTS=ON)")
def test_cpp_app_reproduces_python(tmp_path):
    run_decode_app(APP, tmp_path)
