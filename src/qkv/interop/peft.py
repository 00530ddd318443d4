"""LoRA adapters in PEFT's format (``adapter_config.json`` and ``adapter_model.safetensors``), named here beside
qkv's readers and writers of the other formats. The format itself is :mod:`qkv.adapters`, below both this package
and :mod:`qkv.checkpoint`, whose LoRA runs keep their adapters in it."""

from __future__ import annotations

from ..adapters import (
    CONFIG,
    KEY,
    WEIGHTS,
    key_order,
    load_peft_adapter,
    peft_tensors,
    read_peft_adapter,
    save_peft_adapter,
)

__all__ = ["CONFIG", "KEY", "WEIGHTS", "key_order", "load_peft_adapter", "peft_tensors", "read_peft_adapter",
           "save_peft_adapter"]
