import pytest
import torch


@pytest.fixture(scope="session")
def loaded():
    """SmolLM2-135M-Instruct in float32 with attn_implementation="nexuskv", and its tokenizer."""
    import nexuskv.hf  # noqa: F401  (registers attn_implementation="nexuskv")
    from nexuskv import models

    return models.load_model(torch.float32, attn_implementation="nexuskv")
