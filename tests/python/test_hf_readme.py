"""The README's Hugging Face snippet runs verbatim (docs that cannot rot)."""

import os
import re

from hf_helpers import requires_model

pytestmark = requires_model

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def hf_snippet() -> str:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("**Hugging Face transformers**") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_hugging_face_snippet_runs(capsys):
    code = hf_snippet()
    assert "nexuskv.hf.enable(model" in code and "..." not in code
    namespace = {"__name__": "readme_snippet"}
    exec(compile(code, "README.md (Hugging Face snippet)", "exec"), namespace)
    printed = capsys.readouterr().out.strip().splitlines()
    import nexuskv.hf

    cache = namespace["cache"]
    assert isinstance(cache, nexuskv.hf.NexusKVCache) and printed[-1] == f"{cache.nbytes} bytes in the cache"
    assert cache.get_seq_length() > namespace["inputs"].input_ids.shape[1]
    assert len(printed[0].strip()) > 0  # the generated text
