"""A Hugging Face folder's weights are checked before they are used: a parameter stored as integers (a damaged
header, or a quantized model) and weights that are not finite are refused, each naming the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from qkv.interop import read_safetensors


def _folder(tmp_path, **tensors):
    folder = tmp_path / "model"
    folder.mkdir()
    base = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4),
            "embeddings.position_ids": torch.arange(8)[None]}  # an integer buffer, as older BERT folders hold
    save_file({**base, **tensors}, str(folder / "model.safetensors"))
    return folder


def test_good_weights_are_read_and_integer_buffers_are_kept(tmp_path):
    tensors = read_safetensors(_folder(tmp_path, **{"lm_head.weight": torch.randn(8, 4).half()}))
    assert tensors["lm_head.weight"].dtype == torch.float32 and tensors["embeddings.position_ids"].dtype == torch.int64


def test_a_weight_stored_as_integers_is_refused(tmp_path):
    """What a header that says I32 for F32 bytes gives: integers the model would take as weights."""
    folder = _folder(tmp_path, **{"model.layers.0.mlp.up_proj.weight": torch.randn(6, 4).view(torch.int32)})
    with pytest.raises(ValueError, match=r"model: tensor model\.layers\.0\.mlp\.up_proj\.weight is stored as "
                                         r"torch\.int32, expected floating-point weights"):
        read_safetensors(folder)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused(tmp_path, bad):
    weight = torch.randn(6, 4)
    weight[2, 1] = bad
    with pytest.raises(ValueError, match=r"model holds weights that are not finite \(NaN or Inf\) in 1 tensor\(s\), "
                                         r"e\.g\. model\.layers\.0\.mlp\.up_proj\.weight"):
        read_safetensors(_folder(tmp_path, **{"model.layers.0.mlp.up_proj.weight": weight}))
