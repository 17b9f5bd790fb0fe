"""Writes the inputs of the LibTorch example app (decode.cpp): a TorchScript decoder step
(append this step's K/V to a nexuskv cache, attend with its queries) and a data module with
a prefill, 12 decode steps of random q/k/v and the outputs Python computed for them, which
the app must reproduce over a cache it builds in C++.

    python examples/cpp/make_inputs.py OUT_DIR     # writes OUT_DIR/decoder.pt, OUT_DIR/data.pt
    nexuskv_decode OUT_DIR/decoder.pt OUT_DIR/data.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import nexuskv  # loads the library (torch.classes.nexuskv) and has the cache factory


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


def write_inputs(out_dir: Path) -> tuple[Path, Path]:
    """decoder.pt and data.pt in out_dir (the cache settings are decode.cpp's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
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
    paths = out_dir / "decoder.pt", out_dir / "data.pt"
    torch.jit.save(decoder, str(paths[0]))
    data = torch.jit.script(Data(q=q, k=k, v=v, expected=expected, prefill_k=prefill[0], prefill_v=prefill[1]))
    torch.jit.save(data, str(paths[1]))
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="where decoder.pt and data.pt go")
    for path in write_inputs(p.parse_args().out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
