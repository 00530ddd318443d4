"""LoRA adapters as GGUF LoRA files, which llama.cpp applies to a base model with ``--lora FILE``.

The layout llama.cpp reads (``convert_lora_to_gguf.py`` writes it, ``src/llama-adapter.cpp`` checks it):

=========================  ===================================================================================
``general.architecture``   the base file's (``llama``, ``qwen2``, ``qwen3``); llama.cpp refuses a mismatch
``general.type``           ``"adapter"``
``adapter.type``           ``"lora"``
``adapter.lora.alpha``     α (float32); llama.cpp scales each product by α / r, r read from ``lora_b``
``<base>.lora_a``          ``A`` ``(r, in)`` as numpy holds it (ggml's ``ne = [in, r]``), float32
``<base>.lora_b``          ``B`` ``(out, r)`` (``ne = [r, out]``), float32
=========================  ===================================================================================

``<base>`` is the name of the adapted matrix in the base GGUF file, ``blk.{i}.attn_q.weight`` and so on
(:data:`qkv.interop.families.LLAMA_GGUF`). The adapters come from :func:`~qkv.adapters.peft_tensors`, so a
quantized model's stacked layers give the same file as separate float layers. Where the base file holds the
query and key rows in ggml's interleaved rotary order (``llama``), ``B``'s rows of Q and K are reordered the same
way (:func:`~qkv.interop.gguf_export.permute_rope_rows`): ``B A`` must change the rows the base file holds.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from ..adapters import KEY, key_order, peft_tensors
from ..files import check_out, write_atomically
from ..lora import LLAMA, layout_of, lora_config_of
from ..models import GPT
from .families import LLAMA_GGUF, PERMUTED_ARCHITECTURES
from .gguf import _import_gguf
from .gguf_export import permute_rope_rows

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # the LLaMA family as llama.cpp names it
_GGUF_NAMES = {hf: ours for ours, hf in LLAMA_GGUF.items()}  # self_attn.q_proj -> attn_q


def export_gguf_lora(model: nn.Module, out: str | Path, *, architecture: str | None = None) -> None:
    """Write the LoRA adapters of ``model`` as the GGUF LoRA file ``out`` (see the module's text).

    Args:
        model: a LLaMA-family :class:`~qkv.models.GPT` with LoRA layers (float or quantized base).
        out: the new file.
        architecture: the base GGUF file's ``general.architecture``: what
            :func:`~qkv.interop.gguf_export.export_gguf` writes for the model (the default), or ``llama`` for a
            sliding-window model, which llama.cpp's converter writes as ``llama`` and export_gguf refuses.

    Raises:
        ValueError: a model outside the LLaMA family or without adapters, adapters of different ranks or scales,
            a sliding-window model without ``architecture``, an ``architecture`` other than the model's, or an
            ``out`` that exists.
    """
    gguf = _import_gguf()
    out = Path(out)
    check_out(out, "file")
    if layout_of(model) is not LLAMA:
        raise ValueError("GGUF LoRA adapters are written for the LLaMA family only (llama.cpp runs no Marian "
                         "model); write the adapter with --format peft")
    tensors = peft_tensors(model)  # refuses models without adapters
    config = lora_config_of(model)
    arch = _architecture(model, architecture)
    # llama.cpp always scales by alpha / r (llama_adapter_lora_weight::get_scale); rsLoRA's alpha / sqrt(r) is
    # that with alpha' = alpha * sqrt(r), since alpha' / r = alpha / sqrt(r).
    alpha = config.alpha * math.sqrt(config.rank) if config.rslora else config.alpha
    stored = _gguf_lora_tensors(tensors, model.config, arch)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for name, tensor in stored.items():
            writer.add_tensor(name, tensor.numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write_atomically(out, write)
    log.info("wrote %s: a %s LoRA adapter of %d tensors (rank %d, alpha %g)", out, arch, len(stored), config.rank,
             alpha)


def _architecture(model: GPT, architecture: str | None) -> str:
    """The base file's architecture: the one :func:`export_gguf` writes for ``model``; a sliding-window model
    (which it refuses) only as ``llama``, as llama.cpp's converter writes Mistral."""
    from .hf_gpt import gpt_config_to_hf

    model_type = gpt_config_to_hf(model.config)["model_type"]
    expected = model_type if model_type in ARCHITECTURES else None  # mistral: export_gguf has no file for it
    if architecture is None and expected is None:
        raise ValueError(f"llama.cpp's GGUF files have no sliding window (window={model.config.window}); pass "
                         "architecture='llama' for a base converted by llama.cpp's own converter")
    if architecture is not None and architecture != (expected or "llama"):
        raise ValueError(f"architecture must be {expected or 'llama'!r} (the base's, for this {model_type} model), "
                         f"got {architecture!r}")
    return architecture or expected


def _gguf_lora_tensors(tensors: dict[str, Tensor], cfg, arch: str) -> dict[str, Tensor]:
    """PEFT's names -> ``blk.{i}.{kind}.weight.lora_{a|b}``, in the model's order; B's Q and K rows reordered
    into ggml's rotary pairs where the base file's are."""
    heads = {} if arch not in PERMUTED_ARCHITECTURES else {"attn_q": cfg.n_heads,
                                                            "attn_k": cfg.n_kv_heads or cfg.n_heads}
    out = {}
    for key in sorted(tensors, key=key_order):
        _, layer, module, side = KEY.fullmatch(key).groups()
        kind = _GGUF_NAMES[module]
        tensor = tensors[key]
        if side == "B" and kind in heads:
            tensor = permute_rope_rows(tensor, heads[kind])  # the rows of B A as the base's rows of W
        out[f"blk.{layer}.{kind}.weight.lora_{side.lower()}"] = tensor.to(torch.float32).contiguous()
    return out


__all__ = ["ARCHITECTURES", "export_gguf_lora"]
