"""Loads the native operator library (libnexuskv.so) that sits beside this
package, with an error that says what to do when it is missing or was built
against another torch."""

from __future__ import annotations

import os

import torch

_LIB_NAME = "libnexuskv.so"
_loaded = False


class NativeLibraryError(ImportError):
    pass


def library_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)


def load() -> None:
    global _loaded
    if _loaded:
        return
    path = library_path()
    reinstall = "rebuild it with `pip install --no-build-isolation .` in the nexuskv checkout"
    if not os.path.exists(path):
        raise NativeLibraryError(
            f"nexuskv: the native operator library {path} is missing (an import from the "
            f"source tree instead of an installed package?); {reinstall}"
        )
    from . import _build_info

    built_for = _build_info.TORCH_VERSION
    try:
        torch.ops.load_library(path)
    except OSError as e:
        hint = ""
        if built_for != torch.__version__:
            hint = f" It was built against torch {built_for} but torch {torch.__version__} is installed."
        raise NativeLibraryError(f"nexuskv: cannot load {path}: {e}.{hint} {reinstall}") from e
    if built_for.split("+")[0] != torch.__version__.split("+")[0]:
        raise NativeLibraryError(
            f"nexuskv: {path} was built against torch {built_for}, but torch {torch.__version__} "
            f"is installed; the C++ ABI differs between releases, {reinstall}"
        )
    _loaded = True
