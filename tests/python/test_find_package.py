"""The installed C++ package, from `cmake --install` of this build's cxx component into a
temporary prefix and from the pip-installed wheel (nexuskv.cmake_prefix_path): an outside
CMake project (examples/cpp, configured on its own) that says find_package(nexuskv) with
nothing but that prefix and the Python that has torch, built and run against Python's
outputs (examples/cpp/make_inputs.py)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_cpp_app import run_decode_app

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "py"


def cmake(*args, cwd=None):
    run = subprocess.run(["cmake", *map(str, args)], cwd=cwd, capture_output=True, text=True)
    assert run.returncode == 0, f"cmake {' '.join(map(str, args))}\n{run.stdout}\n{run.stderr}"
    return run.stdout


PUBLIC_HEADERS = {"nexuskv/ops.h", "nexuskv/cache.h", "nexuskv/compressor.h", "nexuskv/core/nq_format.h",
                  "nexuskv/core/hd.h"}


def assert_public_headers_only(include: Path) -> None:
    """The installed headers are the public API (no core internals such as core/attention.h),
    and every nexuskv header they include is installed too."""
    installed = {str(p.relative_to(include)) for p in include.rglob("*.h")}
    assert PUBLIC_HEADERS <= installed, installed
    for header in installed:
        for line in (include / header).read_text().splitlines():
            m = re.match(r'\s*#\s*include\s*[<"](nexuskv/[^>"]+)[>"]', line)
            if m:
                assert m.group(1) in installed, f"{header} includes {m.group(1)}, which is not installed"
    internal = {"nexuskv/core/attention.h", "nexuskv/core/nq_kernels.h", "nexuskv/core/dgq.h"}
    assert not internal & installed, internal & installed


def build_and_run_app(tmp_path: Path, prefix_path: str, lib_dir: Path) -> None:
    """Configures examples/cpp on its own with CMAKE_PREFIX_PATH=prefix_path (no torch path,
    CUDA path or architecture list: the package config finds them itself), builds it, checks
    that it loads libnexuskv from lib_dir, and runs it on the documented inputs."""
    app_build = tmp_path / "app"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    out = cmake("-S", ROOT / "examples" / "cpp", "-B", app_build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_PREFIX_PATH={prefix_path}", f"-DPython_EXECUTABLE={sys.executable}")
    assert "Configuring done" in out
    cmake("--build", app_build)
    app = app_build / "nexuskv_decode"
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib_dir))
    ldd = subprocess.run(["ldd", str(app)], capture_output=True, text=True, env=env).stdout
    assert str(lib_dir / "libnexuskv.so") in ldd, ldd
    assert "OK" in run_decode_app(app, tmp_path, nexuskv_lib_dir=lib_dir)


@pytest.mark.skipif(not (BUILD / "cmake_install.cmake").exists() or shutil.which("cmake") is None,
                    reason=f"needs cmake and the native build in {BUILD}")
def test_outside_app_with_find_package(tmp_path):
    prefix = tmp_path / "prefix"
    cmake("--install", BUILD, "--prefix", prefix, "--component", "cxx")
    config = prefix / "lib" / "cmake" / "nexuskv"
    assert (config / "nexuskvConfig.cmake").exists() and (prefix / "include" / "nexuskv" / "cache.h").exists()
    assert_public_headers_only(prefix / "include")
    assert (prefix / "lib" / "libnexuskv.so").exists()
    # The app must load the installed library (not the build's or the Python package's).
    build_and_run_app(tmp_path, str(prefix), prefix / "lib")


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_outside_app_against_the_pip_installed_package(tmp_path):
    """What a C++ user of the wheel does: CMAKE_PREFIX_PATH=nexuskv.cmake_prefix_path, no
    source tree, no install step of their own."""
    import nexuskv

    package = Path(nexuskv.__file__).resolve().parent
    assert (Path(nexuskv.cmake_prefix_path) / "nexuskv" / "nexuskvConfig.cmake").exists(), nexuskv.cmake_prefix_path
    assert_public_headers_only(package / "include")
    build_and_run_app(tmp_path, nexuskv.cmake_prefix_path, package)
