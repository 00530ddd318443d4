"""Checkpoints written by an earlier qkv (tests/fixtures/checkpoints, made by tests/fixtures/make_checkpoints.py
with the qkv of 2026-11-23) load with today's code and compute what they computed then: the same logits (1e-5)
and the same greedy translations. Their configs record no weight checksum and no tokenizer kinds, as every
checkpoint saved before those were recorded."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = FIXTURES / "checkpoints"


def _maker():
    spec = importlib.util.spec_from_file_location("make_checkpoints", FIXTURES / "make_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fixtures_predate_the_weight_checksum():
    for kind in ("transformer", "lstm", "gpt", "vit"):
        config = json.loads((CHECKPOINTS / kind / "config.json").read_text(encoding="utf-8"))
        assert "weights_sha256" not in json.dumps(config), kind


@pytest.mark.parametrize("kind", ["transformer", "lstm", "gpt", "vit"])
def test_an_earlier_checkpoint_computes_what_it_computed_then(kind):
    expected = json.loads((CHECKPOINTS / "outputs.json").read_text(encoding="utf-8"))[kind]
    now = _maker().outputs(CHECKPOINTS)[kind]
    assert now.keys() == expected.keys()
    torch.testing.assert_close(torch.tensor(now["logits"]), torch.tensor(expected["logits"]), atol=1e-5, rtol=1e-5)
    assert now.get("greedy") == expected.get("greedy")
