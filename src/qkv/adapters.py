"""LoRA adapters in PEFT's format, both ways, for the LLaMA family (llama, mistral, qwen2, qwen3) and Marian
translation models.

    DIR/adapter_config.json          peft_type "LORA", r, lora_alpha, lora_dropout, target_modules, use_rslora, ...
    DIR/adapter_model.safetensors    base_model.model.{module}.lora_A.weight (r, in), ...lora_B.weight (out, r)

    {module}, LLaMA family:   model.layers.{i}.self_attn.{q,k,v,o}_proj, model.layers.{i}.mlp.{gate,up,down}_proj
    {module}, Marian:         model.{encoder,decoder}.layers.{i}.self_attn.{q,k,v,out}_proj, ....{i}.fc1, ....{i}.fc2,
                              model.decoder.layers.{i}.encoder_attn.{q,k,v,out}_proj

PEFT's LoRA computes what :class:`qkv.nn.LoRALinear` computes, ``y = W x + s · B A x`` with ``s = α / r``
(``use_rslora``: ``α / √r``), and its ``A`` and ``B`` are qkv's part for part, so the format is a renaming: PEFT's
module names are Hugging Face's (a :class:`qkv.lora.Layout` says where each is in qkv's model), and qkv's stacked
layers of a quantized model (``self_attn.qkv_proj``, ``feed_forward.gate_up``) hold one adapter per stacked projection
(:meth:`~qkv.nn.LoRALinear.part`), so they read and write the same files as separate layers.

Only plain LoRA is read: an adapter over the unchanged base weights, on every layer's projections, each with the
file's one rank and α. What PEFT adds beyond that (DoRA, biases, per-module ranks, some layers only, extra
trained modules, initialisations that change the base weights, ...) is refused in one line that says so; peft's
own ``merge_and_unload()`` turns any of them into a plain model folder that :func:`~qkv.interop.load_pretrained`
reads. Weights are read from safetensors only, never unpickled.

Below both :mod:`qkv.checkpoint` (a LoRA run's checkpoints hold their adapters in this format) and
:mod:`qkv.interop`: it imports nothing of either.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .files import check_out, quoted, read_json, write_atomically
from .lora import (
    KNOWN_TARGETS,
    LLAMA,
    MARIAN,
    PHI3,
    LoRAConfig,
    add_lora,
    hf_modules,
    layout_of,
    lora_config_of,
    lora_layers,
    modules_of,
    target_of,
)

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PeftModel -> LoraModel -> LlamaForCausalLM (MarianMTModel) -> its model: the prefix of every weight it saves.
_PREFIX = "base_model.model."
# A PEFT LoRA weight's name: (stack, block, "self_attn.q_proj"-like module in the block, A or B); gguf_lora reads
# the same names.
KEY = re.compile(r"base_model\.model\.(model(?:\.encoder|\.decoder)?\.layers)\.(\d+)\.(\w+(?:\.\w+)?)"
                 r"\.lora_([AB])\.weight")
# Every block's modules in the families read, in a block's order.
_MODULES = tuple(dict.fromkeys(m for layout in (LLAMA, PHI3, MARIAN) for ms in layout.layers.values() for m in ms))
# Fields that change what an adapter computes or where it applies: each must hold plain LoRA's value (absent,
# null, false, "none" or empty) to be read.
_NOT_SUPPORTED = ("use_dora", "fan_in_fan_out", "bias", "lora_bias", "rank_pattern", "alpha_pattern",
                  "layers_to_transform", "modules_to_save", "exclude_modules", "layer_replication",
                  "target_parameters", "trainable_token_indices", "alora_invocation_tokens", "use_qalora",
                  "use_bdlora", "kasa_config", "arrow_config", "monteclora_config")
# The initialisations that leave the base weights as they are (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA subtract the
# adapter's start from W, and MiCA is a variant with a forward of its own).
_PLAIN_INITS = ("gaussian", "eva", "orthogonal")  # and true or false
_MERGE = "merge it into its base model with peft's merge_and_unload() and load that folder instead"
# The bounds of the numbers adapter_config.json gives: a rank past any model's width, or an α whose scale would
# overflow float16 activations, is a damaged or hostile file.
MAX_RANK, MAX_ALPHA = 1 << 16, 1e6
# The dtypes an adapter's weights may be stored in (float8 has no isfinite, and no LoRA trainer writes it).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ------------------------------------------------------------------------------------------------- writing


def peft_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The LoRA adapters of ``model`` under PEFT's names: contiguous float32 copies on the CPU.

    Args:
        model: a LLaMA-family :class:`~qkv.models.GPT` or a Marian :class:`~qkv.models.Transformer` with LoRA
            layers (:func:`qkv.lora.add_lora`), separate or stacked projections.

    Returns:
        ``base_model.model.{module}.lora_{A|B}.weight`` -> ``A (r, in)`` or ``B (out, r)``, as
        ``peft.PeftModel.save_pretrained`` names them (see the module's text).

    Raises:
        ValueError: a model of another family (:func:`qkv.lora.layout_of`), or one without LoRA layers.
    """
    layout_of(model)
    if not lora_layers(model):
        raise ValueError("the model has no LoRA layers to write; add them with qkv.lora.add_lora and train them first")
    return {key: weight.detach().to("cpu", torch.float32, memory_format=torch.contiguous_format, copy=True)
            for key, _, weight in _adapter_weights(model)}


def save_peft_adapter(model: nn.Module, config: LoRAConfig, directory: str | os.PathLike, *, base_name: str) -> None:
    """Write the adapters of ``model`` as a PEFT adapter folder (see the module's text), which
    ``peft.PeftModel.from_pretrained(base, directory)`` loads onto the Hugging Face base model.

    The folder is written beside ``directory`` and renamed into place; an existing ``directory`` is never
    overwritten (an empty one is replaced).

    Args:
        model: a LLaMA-family GPT or a Marian Transformer with LoRA layers made with ``config``.
        config: the LoRA settings the adapters were made with, recorded in ``adapter_config.json``.
        directory: the new folder.
        base_name: the base model's name or folder, recorded as ``base_model_name_or_path``.

    Raises:
        ValueError: a model of another family or without LoRA layers, layers whose rank, α, rsLoRA or
            targets differ from ``config``, or a ``directory`` that exists (and is not empty).
    """
    tensors = peft_tensors(model)
    _check_made_with(model, config, tensors)
    directory = Path(directory)
    check_out(directory, "folder")
    peft_config = _peft_config(config, base_name, layout_of(model).task)
    write_atomically(directory, lambda tmp: _write(tmp, tensors, peft_config), folder=True)


# The Hugging Face ids of the models qkv knows by name: what peft's from_pretrained resolves.
HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def peft_base_name(source: str) -> str:
    """``base_model_name_or_path`` for a base model qkv loaded from ``source``: the Hugging Face id of a model qkv
    knows by name (``"smollm2"``), else ``source`` as given (a folder transformers loads as it is; for a GGUF file
    or a qkv run, docs/finetuning.md says what to load as peft's base)."""
    return HUB_IDS.get(source, source)


def _check_made_with(model: nn.Module, config: LoRAConfig, tensors: Mapping[str, Tensor]) -> None:
    """Every layer's adapter must be what ``adapter_config.json`` will say: a file that says otherwise would load
    with another scale, or with adapters missing, in peft."""
    for name, layer in lora_layers(model).items():
        if (layer.rank, layer.alpha, layer.rslora) != (config.rank, config.alpha, config.rslora):
            raise ValueError(f"{name} has rank {layer.rank}, alpha {layer.alpha:g}, rslora {layer.rslora}, but the "
                             f"config says rank {config.rank}, alpha {config.alpha:g}, rslora {config.rslora}; pass "
                             "the LoRAConfig the adapters were made with")
    expected = {_key(module, side) for module in hf_modules(model, layout_of(model))
                if target_of(module) in config.targets for side in "AB"}
    for what, keys in (("has no adapter", sorted(expected - tensors.keys())),
                       ("has an adapter the config does not target", sorted(tensors.keys() - expected))):
        if keys:
            raise ValueError(f"the model {what} for {keys[0]} (targets {list(config.targets)}); pass the "
                             "LoRAConfig the adapters were made with, applied to every layer (add_lora)")


def _peft_config(config: LoRAConfig, base_name: str, task: str) -> dict[str, Any]:
    """``adapter_config.json`` as peft writes it for plain LoRA on a model of PEFT's ``task``. Fields that peft
    added later (``lora_bias``, ``exclude_modules``, ...) are left to their defaults: older peft versions refuse
    fields they do not know."""
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base_name,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": int(config.alpha) if float(config.alpha).is_integer() else config.alpha,  # peft types it int
        "lora_dropout": config.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": config.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(config.targets),
        "task_type": task,
        "use_dora": False,
        "use_rslora": config.rslora,
    }


def _write(folder: Path, tensors: dict[str, Tensor], peft_config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    (folder / CONFIG).write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})  # its mode: write_atomically sets it


# ------------------------------------------------------------------------------------------------- reading


def read_peft_adapter(directory: str | os.PathLike) -> tuple[LoRAConfig, dict[str, Tensor]]:
    """The LoRA settings and weights of a PEFT adapter folder, checked (see the module's text).

    Args:
        directory: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns:
        The settings as a :class:`~qkv.lora.LoRAConfig` (its targets: those of ``target_modules`` that the
        weights adapt; ``"all-linear"``: all they adapt) and the weights under PEFT's names, in float32.

    Raises:
        ValueError: one line naming the file and the problem: a missing file (or pickled weights only), a config
            that is not JSON, not LoRA, or uses a feature qkv does not read, targets that are not among
            :data:`~qkv.lora.KNOWN_TARGETS`, a rank or α that is not a positive number, weights that are not finite, do
            not have the rank, or are not the LoRA weights of the targets.
    """
    directory = Path(directory)
    _check_files(directory)
    config = _lora_config(read_json(directory / CONFIG), directory / CONFIG)
    tensors = _read_weights(directory / WEIGHTS, config)
    found = {target_of(KEY.fullmatch(key).group(3)) for key in tensors}
    return dataclasses.replace(config, targets=tuple(t for t in config.targets if t in found)), tensors


def _check_files(directory: Path) -> None:
    if directory.is_file() and _starts_with(directory, b"GGUF"):
        raise ValueError(f"{directory} is a GGUF file (a GGUF LoRA adapter is for llama.cpp's --lora); qkv reads "
                         f"adapters in PEFT's format: give the folder with {CONFIG} and {WEIGHTS} (qkv export "
                         "--format peft writes one from a qkv run)")
    if not directory.is_dir():
        raise ValueError(f"cannot read the PEFT adapter {directory}: " + (
            f"a file, not a folder; give the folder with {CONFIG} and {WEIGHTS}" if directory.exists() else
            "no such folder"))
    if not (directory / CONFIG).is_file():
        raise ValueError(f"{directory} has no {CONFIG}: expected a PEFT adapter folder ({CONFIG} and {WEIGHTS}, as "
                         "peft's save_pretrained writes it)")
    if not (directory / WEIGHTS).is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        raise ValueError(f"{directory} has no {WEIGHTS}" + (
            " but pickled adapter_model.bin, which qkv does not read (it can run code); save the adapter again with "
            "peft's save_pretrained(..., safe_serialization=True)" if pickled else
            f": expected a PEFT adapter folder ({CONFIG} and {WEIGHTS}, as peft's save_pretrained writes it)"))


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def _lora_config(raw: dict[str, Any], path: Path) -> LoRAConfig:
    """The plain-LoRA settings of a parsed ``adapter_config.json``, or one ValueError naming ``path``."""
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type={quoted(raw.get('peft_type'))}, expected 'LORA': qkv reads LoRA "
                         "adapters only")
    for field in _NOT_SUPPORTED:
        value = raw.get(field)
        if value not in (None, False, "none") and value != {} and value != []:
            raise ValueError(f"{path}: {field}={quoted(value)} is not supported (qkv reads plain LoRA adapters); "
                             f"{_MERGE}")
    init = raw.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init in _PLAIN_INITS):
        raise ValueError(f"{path}: init_lora_weights={quoted(init)} is not supported: it changes the base model's "
                         f"weights or how the adapter computes (qkv reads true, false, "
                         f"{', '.join(map(repr, _PLAIN_INITS))}); {_MERGE}")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise ValueError(f"{path}: r={quoted(rank)}, expected a positive whole number of at most {MAX_RANK} (the "
                         "adapters' rank)")
    # compared before any float(): a JSON integer of 400 digits is a Python int no float holds
    if not _is_number(alpha) or not 0 < alpha <= MAX_ALPHA or not math.isfinite(alpha):
        raise ValueError(f"{path}: lora_alpha={quoted(alpha)}, expected a positive number of at most {MAX_ALPHA:g}")
    dropout, rslora = raw.get("lora_dropout", 0.0), raw.get("use_rslora", False)
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"{path}: lora_dropout={quoted(dropout)}, expected a number in [0, 1)")
    if not isinstance(rslora, bool):
        raise ValueError(f"{path}: use_rslora={quoted(rslora)}, expected true or false")
    return LoRAConfig(rank=rank, alpha=float(alpha), dropout=float(dropout), rslora=rslora,
                      targets=_targets(raw.get("target_modules"), path))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _targets(modules: Any, path: Path) -> tuple[str, ...]:
    """qkv's targets from ``target_modules``: "all-linear" (every target), or a list of module names, each a
    target or a module path ending in one (peft matches a list's names as suffixes; it writes "all-linear" out
    as the full paths of the modules it matched)."""
    if modules == "all-linear":
        return KNOWN_TARGETS
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise ValueError(f"{path}: target_modules={quoted(modules)} is not supported: expected a list of module names "
                         f"among {', '.join(KNOWN_TARGETS)} (a regular expression is not read), or 'all-linear'")
    targets = {target_of(m) for m in modules}
    unknown = sorted(m for m in modules if target_of(m) not in KNOWN_TARGETS)
    if unknown:
        raise ValueError(f"{path}: target_modules names {quoted(unknown)}, which are not projections of the LLaMA "
                         f"family or of Marian; expected names among {', '.join(KNOWN_TARGETS)}")
    return tuple(t for t in KNOWN_TARGETS if t in targets)


def _read_weights(path: Path, config: LoRAConfig) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"cannot read {path}: {str(err).strip().splitlines()[0]}") from None
    if not tensors:
        raise ValueError(f"{path} holds no weights; save the adapter again with peft's save_pretrained")
    for key in sorted(tensors, key=key_order):  # the first problem in the model's order is named
        _check_weight(key, tensors[key], config, path)
        pair = key[: -len("A.weight")] + ("B.weight" if key.endswith("A.weight") else "A.weight")
        if pair not in tensors:
            raise ValueError(f"{path} has {key} but not {pair}; the file is incomplete: save the adapter again")
    return {key: tensor.float() for key, tensor in tensors.items()}


def _check_weight(key: str, tensor: Tensor, config: LoRAConfig, path: Path) -> None:
    match = KEY.fullmatch(key)
    module = match.group(3) if match else None
    if module not in _MODULES:
        raise ValueError(f"{path}: {key} is not a LoRA weight of a LLaMA-family or Marian projection (expected "
                         f"{_PREFIX}{{stack}}.{{i}}.{{module}}.lora_{{A|B}}.weight, see qkv.adapters): the "
                         f"adapter is for another kind of model or uses a feature qkv does not read; {_MERGE}")
    if target_of(module) not in config.targets:
        raise ValueError(f"{path}: {key} adapts a module that target_modules in {CONFIG} does not list "
                         f"({list(config.targets)}): the two files do not belong together; save the adapter again")
    side = match.group(4)
    expected = f"({config.rank}, in)" if side == "A" else f"(out, {config.rank})"
    if tensor.dtype not in FLOAT_DTYPES or tensor.dim() != 2 or tensor.shape[0 if side == "A" else 1] != config.rank:
        raise ValueError(f"{path}: {key} is {str(tensor.dtype).removeprefix('torch.')} of shape {tuple(tensor.shape)}, "
                         f"expected floating-point weights of shape {expected} (r={config.rank} in {CONFIG}), "
                         "float16, bfloat16, float32 or float64")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{path}: {key} holds weights that are not finite (NaN or Inf); the adapter is damaged: "
                         "use another copy, or train it again")


# ------------------------------------------------------------------------------------------------- loading


def load_peft_adapter(model: nn.Module, directory: str | os.PathLike) -> LoRAConfig:
    """Add the PEFT adapter in ``directory`` to ``model`` (in place, with :func:`qkv.lora.add_lora`).

    Strict: every adapter qkv adds gets its weights from the file, every weight of the file is used, and each
    must have the shape of the model's layer. A model loaded with quantized weights holds its projections
    stacked; each stacked part gets its projection's adapter. On failure the model is left as it was.

    Args:
        model: a LLaMA-family :class:`~qkv.models.GPT` or a Marian :class:`~qkv.models.Transformer` (float or
            quantized), without LoRA layers or with those of this very adapter (a resumed run: their weights are
            read back).
        directory: the adapter folder (see :func:`read_peft_adapter`).

    Returns:
        The adapter's LoRA settings.

    Raises:
        ValueError: one line: a model of another family or with other LoRA layers already, anything
            :func:`read_peft_adapter` refuses, or an adapter made for another base model (a weight whose shape
            differs from its layer's, the first such layer named; a layer the model does not have; adapters
            missing).
    """
    layout_of(model)
    config, tensors = read_peft_adapter(directory)
    if lora_layers(model):  # a run resumed: the same adapters, their weights read back
        if lora_config_of(model) != config:
            raise ValueError(f"{directory}: the adapter ({config}) is not the one the model has "
                             f"({lora_config_of(model)}); load it onto the base model")
        _fill(model, tensors)
        return config
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        add_lora(model, config)
        _fill(model, tensors)
    except ValueError as err:
        _remove_lora(model, trainable)
        raise ValueError(f"{directory}: {err}") from None
    return config


def _fill(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    slots = {key: (name, weight) for key, name, weight in _adapter_weights(model)}
    for key, (name, weight) in slots.items():  # the model's order: the first layer that differs is named
        if key in tensors and tensors[key].shape != weight.shape:
            raise ValueError(f"{key} has shape {tuple(tensors[key].shape)} but qkv's {name} needs "
                             f"{tuple(weight.shape)}: the adapter was made for another base model")
    unused = sorted((key for key in tensors if key not in slots), key=key_order)
    if unused:
        layers = ", ".join(f"{len(model.get_submodule(stack))} {stack.split('.')[0]} layers"
                           for stack in layout_of(model).stacks)
        raise ValueError(f"{unused[0]} is for a layer this model does not have ({layers}): the adapter was made for "
                         "another base model")
    missing = [key for key in slots if key not in tensors]
    if missing:
        raise ValueError(f"the adapter has no {missing[0]} ({len(missing)} weights missing); qkv adapts its targets in "
                         "every layer: the adapter was made for another base model, or for some layers only")
    with torch.no_grad():
        for key, (_, weight) in slots.items():
            weight.copy_(tensors[key])


def _remove_lora(model: nn.Module, trainable: Mapping[str, bool]) -> None:
    """Undo :func:`add_lora`: each adapted layer back to its base, each parameter as trainable as it was."""
    for name, layer in lora_layers(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.base)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable.get(name, p.requires_grad))


# ------------------------------------------------------------------------------------------------- names


def _adapter_weights(model: nn.Module) -> Iterator[tuple[str, str, Tensor]]:
    """(PEFT's key, qkv's layer name, the weight: a view of the layer's parameters) of every adapter part."""
    layout = layout_of(model)
    for name, layer in lora_layers(model).items():
        for module, part in modules_of(name, layer, layout):
            a, b = layer.part(part)
            yield _key(module, "A"), name, a
            yield _key(module, "B"), name, b


def _key(module: str, side: str) -> str:
    return f"{_PREFIX}{module}.lora_{side}.weight"


def key_order(key: str) -> tuple[int, int, int, str]:
    """Sorts PEFT's keys as the model holds its layers: the encoder's before the decoder's, by block, then by
    projection; other keys first."""
    match = KEY.fullmatch(key)
    if match is None:
        return -1, 0, 0, key
    stack, block, module, _ = match.groups()
    position = _MODULES.index(module) if module in _MODULES else len(_MODULES)
    return int(stack.endswith("decoder.layers")), int(block), position, key


__all__ = ["HUB_IDS", "load_peft_adapter", "peft_base_name", "peft_tensors", "read_peft_adapter",
           "save_peft_adapter"]
