"""A GGUF file's tensors straight into qkv's layers: quantized at rest, one tensor at a time.

:func:`~qkv.interop.gguf.load_gpt_from_gguf` dequantizes every tensor to float32 and loads the model as a
Hugging Face checkpoint: the reference path, exact to what any other reader computes from the file, and four
to eight times the file's size in memory. This module builds the same model without that copy. The file is
read through a memory map; each weight matrix goes from its blocks into the layer that holds it, a few hundred
rows at a time, and the float32 model is never made:

==========================  ==============================  ============================================
stored as                   ``mode="auto"`` (the default)   what that costs
==========================  ==============================  ============================================
Q4_0, Q4_1                  int4, groups of 32: the codes   nothing with qkv's kernel (fp16 scales and
                            taken over as they are          offsets as stored); PyTorch's rounds them to
                                                            bf16 (at most 2⁻⁹ of each)
Q4_K                        int4, groups of 32, as above    each group's scale d·sc and offset in fp16
                                                            (bf16 with PyTorch's kernel)
Q8_0                        int8, its blocks as stored      nothing with qkv's kernel; with PyTorch's,
                            (qkv's kernel), else per row    per row again as below
Q6_K, Q5_K                  6 or 5 bits, the blocks as      nothing with qkv's kernel on AVX-512 (a
                            stored (qkv's kernel with       layer whose tensors are all Q6_K or all
                            AVX-512), else as below         Q5_K); else as below
Q5_K, Q6_K, F16, BF16, F32  int8, quantized again: a scale  half an int8 step of the block's (or, with
(matrices)                  per 32 inputs with qkv's        PyTorch's kernel, the row's) largest weight
                            kernel, per row with PyTorch's
token embedding             int8 as above, or Q6_K/Q5_K as  as int8; the lookup widens one row a token
                            stored (shared with the output
                            layer when tied)
norms, biases               fp32                            none
==========================  ==============================  ============================================

``mode="int4"`` quantizes every matrix to int4 (the 4-bit formats as above, the others again from their
values); ``"int8"`` every matrix to int8; ``"none"`` builds float32 layers, the reference path's numbers in its
memory; ``"bf16"`` bfloat16 layers, half that memory (fast where the CPU multiplies bf16 natively, slow where it
does not: measure). As :func:`qkv.quantize.quantize` does, the output layer is int8 in every quantized mode, with its
largest logits recomputed in fp32, and the Q, K, V projections (and the gate and up projections) are stacked
into one layer each, built from the file's rows directly.

The configuration, the names and the shapes are checked by the same strict converter as the reference path,
run on tensors that hold shapes only, before any weight is read; the memory the layers will take is checked
against the machine's next.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..files import check_finite
from ..footprint import check_fits, return_freed_memory
from ..kernels import SUPER
from ..models import GPT
from ..models.common import skip_init
from ..nn import StackedFeedForward, StackedSelfAttention
from ..nn.moe import MoEFeedForward
from ..quantize import int4_class, int8_class
from ..quantized import Int4Linear, Int8Linear, QuantizedEmbedding, QuantizedLinear
from .experts import read_name
from .families import MULTIMODAL, family, norm_shift, text_model, text_tensor
from .ggml_blocks import (
    GROUP,
    REPACKED,
    SPANS,
    dequantized_rows,
    int4_groups,
    int4_halves,
    int8_blocks,
    q5_k_blocks,
    q6_k_blocks,
)
from .gguf import (
    PERMUTED_ARCHITECTURES,
    ROPE_TENSORS,
    GGUFContents,
    hf_config_from_gguf,
    hf_state_dict_from_gguf,
    open_gguf,
)
from .gguf_file import GGUFHeader
from .hf_gpt import gpt_config_from_hf, gpt_state_dict_from_hf

log = logging.getLogger(__name__)

MODES = ("auto", "int4", "int8", "none", "bf16")
FLOAT_LAYERS = ("none", "bf16")  # the modes that quantize nothing: float32 or bfloat16 layers
K_QUANTS = {"Q6_K": "int6", "Q5_K": "int5"}  # the K-quants qkv's kernel holds as stored in mode "auto"
CHUNK_ROWS = 512  # rows decoded at once: a layer's float32 rows never all exist together


class _Source:
    """One stored weight: its name, how it is stored (``kind``), its rows and inputs, and its rows in float32,
    a chunk at a time."""

    name: str
    kind: str  # a ggml type name ("Q4_1", "F16") or a safetensors dtype ("BF16")
    rows: int
    inputs: int
    path: Path

    def rows_at(self, start: int, end: int) -> Tensor:
        raise NotImplementedError

    def release(self, rows: tuple[int, int] | None = None) -> None:
        """Done with (these rows of) it: the file's pages they were read from need not stay in this process's
        memory."""

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        """``(first row, float32 rows)`` chunk by chunk, checked finite."""
        for start, end in self.spans():
            values = self.rows_at(start, end)
            check_finite([(self.name, values)], f"{self.path} holds", "the file is damaged; use another copy")
            yield start, values

    def spans(self) -> Iterator[tuple[int, int]]:
        """``(first, past-the-last row)`` of each chunk, the file's pages of each let go once the caller is done
        with it (when it asks for the next)."""
        for start in range(0, self.rows, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, self.rows)
            yield start, end
            self.release((start, end))


class _GGUFSource(_Source):
    """A GGUF tensor and the order its rows go in (llama.cpp's rotary reordering of Q and K undone)."""

    def __init__(self, tensor: Any, path: Path, heads: int | None = None) -> None:
        self.name, self.kind, self.tensor, self.path = tensor.name, tensor.tensor_type.name, tensor, path
        self.rows, self.inputs = tensor.data.shape[0], int(tensor.shape[0])
        self.order = None if heads is None else _unpermuted_order(self.rows, heads)  # None: the file's order

    def raw(self, start: int, end: int) -> np.ndarray:
        """The stored bytes of rows ``start ... end - 1`` in the model's order: a view of the file's memory map
        where those rows lie in the file's order, else a copy (only these pages of the file are read)."""
        if self.order is None:
            return self.tensor.data[start:end]
        return self.tensor.data[self.order[start:end]]

    def release(self, rows: tuple[int, int] | None = None) -> None:
        if rows is None or self.order is None:  # reordered rows (Q and K of a llama file): their pages at the end
            self.tensor.release(rows)

    def rows_at(self, start: int, end: int) -> Tensor:
        values = dequantized_rows(self.kind, self.raw(start, end), self.tensor.tensor_type)
        return torch.from_numpy(values.reshape(end - start, -1))


class _SafetensorsSource(_Source):
    """A tensor of a safetensors file, read through its memory map a slice at a time."""

    def __init__(self, handle: Any, name: str, path: Path) -> None:
        self.handle, self.name, self.path = handle, name, path
        tensor = handle.get_slice(name)
        shape = tensor.get_shape()
        self.kind = tensor.get_dtype()
        self.stack = shape[1] if len(shape) == 3 else None  # a stack of experts' matrices: the rows of each
        self.rows, self.inputs = (int(np.prod(shape[:-1])), shape[-1]) if len(shape) > 1 else (1, shape[0])

    def rows_at(self, start: int, end: int) -> Tensor:
        tensor = self.handle.get_slice(self.name)
        if self.rows == 1:
            return tensor[:].float()[None]
        if self.stack is not None:  # rows of one expert's matrix (as the builder asks for them)
            expert, first = divmod(start, self.stack)
            return tensor[expert : expert + 1, first : first + end - start].float()[0]
        return tensor[start:end].float()


class _Rows(_Source):
    """Rows ``first ... first + rows - 1`` of a stored tensor: one part of a fused one (Phi-3's Q, K and V in one
    matrix, its gate and up projections in another)."""

    def __init__(self, whole: _Source, first: int, rows: int) -> None:
        self.whole, self.first, self.rows = whole, first, rows
        self.name, self.kind, self.inputs, self.path = whole.name, whole.kind, whole.inputs, whole.path

    def raw(self, start: int, end: int) -> np.ndarray:
        return self.whole.raw(self.first + start, self.first + end)

    def rows_at(self, start: int, end: int) -> Tensor:
        return self.whole.rows_at(self.first + start, self.first + end)

    def release(self, rows: tuple[int, int] | None = None) -> None:
        self.whole.release(None if rows is None else (self.first + rows[0], self.first + rows[1]))


def _parts(whole: _Source, rows: list[int]) -> list[_Source]:
    firsts = np.cumsum([0, *rows[:-1]]).tolist()
    return [_Rows(whole, first, n) for first, n in zip(firsts, rows, strict=True)]


def _unpermuted_order(rows: int, heads: int) -> np.ndarray:
    """Which stored row each model row is: the inverse of llama.cpp's pairing of rotary rows (see
    :func:`~qkv.interop.gguf.unpermute_rope_rows`, applied here to row numbers instead of rows)."""
    from .gguf import unpermute_rope_rows

    return unpermute_rope_rows(torch.arange(rows, dtype=torch.float64)[:, None], heads)[:, 0].long().numpy()


def load_quantized_gpt(source: str | Path | GGUFHeader, *, mode: str = "auto") -> tuple[GPT, dict[str, Any]]:
    """A :class:`GPT` from a GGUF file of the LLaMA family (any architecture of
    :data:`qkv.interop.families.GGUF_FAMILIES`), its weights quantized at rest (see the module's text).

    Args:
        source: the ``.gguf`` file, or its header as :func:`~qkv.interop.gguf.open_gguf` read it (so that the
            metadata, a vocabulary among it, is read once).
        mode: "auto" (each matrix as close to its stored form as qkv's layers hold it), "int4", "int8",
            "none" (float32) or "bf16".

    Returns:
        The model in eval mode, and the file's metadata (the tokenizer and chat template are made of it).

    Raises:
        ValueError: as :func:`~qkv.interop.gguf.read_gguf` and the strict converter do; an unknown mode; layers
            that would not fit in the memory available; a weight that is not finite (named).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} for a GGUF file; choose one of {', '.join(MODES)}")
    header = source if isinstance(source, GGUFHeader) else open_gguf(source)[0]
    path, metadata = header.path, header.metadata
    tensors = {t.name: t for t in header.tensors}
    cfg = _checked_config(path, metadata, tensors)
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads or cfg.n_heads}
    if metadata.get("general.architecture") not in PERMUTED_ARCHITECTURES:
        heads = {}
    sources = {name: _GGUFSource(t, path, heads.get(name.split(".")[-2])) for name, t in tensors.items()}
    shift = norm_shift(metadata.get("general.architecture"))
    return _build(cfg, sources, path, mode, norm_shift=shift), metadata


def load_hf_gpt_at_rest(folder: str | Path, hf_config: dict[str, Any], *, mode: str = "none") -> GPT:
    """A :class:`GPT` from a Hugging Face folder of the LLaMA family (any ``model_type`` of
    :data:`qkv.interop.families.FAMILIES`, or a multimodal Gemma 3's text model), read
    through memory maps of its safetensors files and converted (``mode`` "none": float32; "bf16") or quantized
    ("int8", "int4"; "auto" is int8 for these) a chunk of rows at a time.

    Raises:
        ValueError: as :func:`~qkv.interop.hf_folder.open_safetensors` and the strict converter do; an unknown
            mode; layers that would not fit in the memory available.
    """
    from .hf_folder import open_safetensors

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    folder = Path(folder)
    # each tensor under its name in the text model -> (its file's handle, the file, its name there)
    tensors = {name: (handle, path, name) for name, (handle, path) in open_safetensors(folder).items()}
    if hf_config.get("model_type") in MULTIMODAL:  # the text model's tensors alone, under its own names
        read = {text_tensor(name): entry for name, entry in tensors.items() if text_tensor(name) is not None}
        log.warning("%s: a multimodal %s folder; its text model is read, not its vision tower and projector (%d "
                    "tensors)", folder.name, hf_config["model_type"], len(tensors) - len(read))
        tensors, hf_config = read, text_model(hf_config)
    cfg = gpt_config_from_hf(hf_config)
    shapes = {name: torch.empty(h.get_slice(stored).get_shape(), device="meta")
              for name, (h, _, stored) in tensors.items()}
    try:
        gpt_state_dict_from_hf(shapes, cfg, hf_config["model_type"])  # every name and shape, before any weight
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
    sources = {}
    gguf_names = {hf: gguf for gguf, hf in family(hf_config["model_type"]).gguf_names.items()}
    for name, (handle, path, stored) in tensors.items():
        gguf_name = _gguf_name(name.removeprefix("model."), gguf_names)
        if gguf_name is not None:
            sources[gguf_name] = _SafetensorsSource(handle, stored, path)
    return _build(cfg, sources, folder, mode)


_HF_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(\w+)_proj")  # one expert's matrix, stored on its own


def _gguf_name(hf_name: str, layer_names: dict[str, str]) -> str | None:
    """A Hugging Face name (without ``model.``) -> its GGUF name, which the builder speaks (``layer_names``: the
    family's, Hugging Face -> GGUF; an expert stored on its own: ``ffn_gate_exps.{e}``); None for another."""
    from .gguf import GLOBAL_NAMES

    for gguf, hf in GLOBAL_NAMES.items():
        if hf_name == f"{hf.removeprefix('model.')}.weight":
            return f"{gguf}.weight"
    match = _HF_LAYER.fullmatch(read_name(hf_name))
    if match is None:
        return None
    expert = _HF_EXPERT.fullmatch(match[2])
    layer = f"ffn_{expert[2]}_exps.{expert[1]}" if expert else layer_names.get(match[2])
    return None if layer is None else f"blk.{match[1]}.{layer}.{match[3]}"


def _build(cfg, sources: dict[str, _Source], path: Path, mode: str, *, norm_shift: float = 0.0) -> GPT:
    builder = _Builder(path, mode, sources, cfg, norm_shift=norm_shift)
    check_fits(builder.bytes_needed(), f"{path.name} in qkv's layers ({mode})")
    with skip_init():  # every weight is set from the file below; untouched memory is never resident
        model = GPT(cfg)
    if mode == "bf16":
        for param in model.parameters():  # new, untouched memory: the float32 pages are never read
            param.data = torch.empty_like(param, dtype=torch.bfloat16)
    builder.fill(model)
    if mode not in FLOAT_LAYERS:
        log.info("%s: weights kept quantized (%s); --quantize none for float32", path.name, builder.summary())
    elif mode == "bf16":
        log.info("%s: weights in bf16 (--precision fp32 for float32)", path.name)
    return model.eval()


def _checked_config(path: Path, metadata: dict, tensors: dict):
    """The model's config, after the strict converter has checked every name and shape on shape-only tensors."""
    shapes = {name: torch.empty(tuple(reversed([int(n) for n in t.shape])), device="meta")
              for name, t in tensors.items()}
    for name in ROPE_TENSORS:  # values, not shapes: they go into the config
        if name in tensors:
            shapes[name] = _vector(_GGUFSource(tensors[name], path))
    contents = GGUFContents(path=path, metadata=metadata, tensors=shapes,
                            tensor_types={name: t.tensor_type.name for name, t in tensors.items()})
    hf_config = hf_config_from_gguf(contents)
    cfg = gpt_config_from_hf(hf_config)
    try:
        gpt_state_dict_from_hf(hf_state_dict_from_gguf(contents, hf_config), cfg, hf_config["model_type"])
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return cfg


class _Builder:
    """Makes each of a model's layers from its stored tensors, named as in GGUF files."""

    def __init__(self, path: Path, mode: str, tensors: dict[str, _Source], cfg, *, norm_shift: float = 0.0) -> None:
        self.path, self.mode, self.tensors, self.cfg, self.norm_shift = path, mode, tensors, cfg, norm_shift
        d_q, d_kv = cfg.n_heads * cfg.head_dim, (cfg.n_kv_heads or cfg.n_heads) * cfg.head_dim
        # the rows of each part of a fused tensor, and of each expert's matrix in a stack of them
        self.rows = {"q": d_q, "kv": d_kv, "ff": cfg.d_ff, "expert": cfg.expert_d_ff or cfg.d_ff}
        self.made: Counter[str] = Counter()  # "Q4_1 -> int4 as stored": tensors of each kind, for the log

    def summary(self) -> str:
        """What the file's tensors became, e.g. "210 Q4_1 -> int4 as stored, 1 Q8_0 -> int8 per row"."""
        return ", ".join(f"{n} {what}" for what, n in sorted(self.made.items()))

    def source(self, name: str) -> _Source:
        return self.tensors[name]

    def qkv_sources(self, prefix: str) -> list[_Source]:
        """The Q, K and V projections' weights of layer ``prefix``: three tensors, or the parts of one (Phi-3)."""
        if f"{prefix}.attn_qkv.weight" in self.tensors:
            return _parts(self.source(f"{prefix}.attn_qkv.weight"), [self.rows["q"], self.rows["kv"], self.rows["kv"]])
        return [self.source(f"{prefix}.{n}.weight") for n in ("attn_q", "attn_k", "attn_v")]

    def gate_up_sources(self, prefix: str) -> list[_Source]:
        """The gate and up projections' weights: two tensors, or the halves of one (Phi-3's ``ffn_up``)."""
        if f"{prefix}.ffn_gate.weight" not in self.tensors:
            return _parts(self.source(f"{prefix}.ffn_up.weight"), [self.rows["ff"], self.rows["ff"]])
        return [self.source(f"{prefix}.{n}.weight") for n in ("ffn_gate", "ffn_up")]

    def expert_sources(self, prefix: str, e: int) -> tuple[list[_Source], list[_Source]]:
        """Expert ``e``'s gate and up projections, and its down projection: rows of the layer's stacks of every
        expert's (GGUF's ``ffn_gate_exps``; ``ffn_gate_up_exps``, each expert's gate rows then its up rows), or its
        own tensors (a Hugging Face folder's, one an expert)."""
        ff, d = self.rows["expert"], self.cfg.d_model
        if f"{prefix}.ffn_gate_up_exps.weight" in self.tensors:
            gate_up = _parts(self.source(f"{prefix}.ffn_gate_up_exps.weight"), [e * 2 * ff, ff, ff])[1:]
        elif f"{prefix}.ffn_gate_exps.weight" in self.tensors:
            gate_up = [_Rows(self.source(f"{prefix}.ffn_{n}_exps.weight"), e * ff, ff) for n in ("gate", "up")]
        else:
            gate_up = [self.source(f"{prefix}.ffn_{n}_exps.{e}.weight") for n in ("gate", "up")]
        down = _Rows(self.source(f"{prefix}.ffn_down_exps.weight"), e * d, d) \
            if f"{prefix}.ffn_down_exps.weight" in self.tensors else self.source(f"{prefix}.ffn_down_exps.{e}.weight")
        return gate_up, [down]

    def set_norm(self, norm: nn.Module | None, name: str) -> None:
        """Norm ``norm``'s gains from tensor ``name`` (a GGUF file of Gemma's stores 1 + w: ``norm_shift``)."""
        if norm is None:
            return
        with torch.no_grad():
            norm.weight.copy_(_vector(self.source(name)).reshape(norm.weight.shape) - self.norm_shift)

    def format(self, sources: list[_Source], *, output: bool = False) -> str:
        """What a layer from ``sources`` becomes: "int4", "int8", "int6" or "int5" (Q6_K or Q5_K blocks as stored,
        by default with qkv's kernel) or the mode's float layers."""
        if self.mode in FLOAT_LAYERS:
            return self.mode
        inputs, kinds = sources[0].inputs, {s.kind for s in sources}
        if self.mode == "auto" and kinds in ({"Q6_K"}, {"Q5_K"}) and inputs % SUPER == 0 and holds_k_quants():
            return K_QUANTS[kinds.pop()]
        if output or self.mode == "int8":
            return "int8"
        if self.mode == "int4" or all(s.kind in REPACKED for s in sources):
            return "int4"
        return "int8"

    def bytes_needed(self) -> int:
        """What the model's layers will take: codes and scales by format, fp32 for the rest."""
        cfg = self.cfg
        d, vocab = cfg.d_model, cfg.vocab_size
        d_q, d_kv, d_ff = self.rows["q"], self.rows["kv"], cfg.d_ff
        int8 = 1.0 if int8_class(d) is Int8Linear else 1 + 2 / GROUP  # a scale per row, or per block
        per_weight = {"int4": 0.5 + 4 / GROUP, "int5": 180 / SUPER, "int6": 210 / SUPER, "int8": int8, "none": 4.0,
                      "bf16": 2.0}
        total = 0.0
        for i in range(cfg.n_layers):
            prefix = f"blk.{i}"
            parts = [(self.qkv_sources(prefix), (d_q + 2 * d_kv) * d),
                     ([self.source(f"{prefix}.attn_output.weight")], d * d_q)]
            if cfg.n_experts is None or cfg.layer(i).dense:
                parts += [(self.gate_up_sources(prefix), 2 * d_ff * d),
                          ([self.source(f"{prefix}.ffn_down.weight")], d * d_ff)]
            else:  # every expert alike; the router (and a shared expert's gate) in fp32
                gate_up, down = self.expert_sources(prefix, 0)
                ff, shared = self.rows["expert"], cfg.shared_expert_d_ff or 0
                parts += [(gate_up, 2 * ff * d * cfg.n_experts), (down, d * ff * cfg.n_experts),
                          ([], (cfg.n_experts + 1) * d), ([], 3 * shared * d)]
            total += sum(per_weight[self.format(sources) if sources else "none"] * size for sources, size in parts)
        tables = 1 if cfg.tie_embeddings else 2
        table = per_weight[self.format([self.source("token_embd.weight")], output=True)] * vocab * d
        return int(total + cfg.n_layers * 8 * d + tables * table)

    def fill(self, model: GPT) -> None:
        for i, layer in enumerate(model.decoder.layers):
            self._fill_layer(layer, f"blk.{i}")
            return_freed_memory()  # the layer's temporaries, freed between its buffers: their pages back
        self.set_norm(model.decoder.norm, "output_norm.weight")
        embedding, tied = self.source("token_embd.weight"), model.config.tie_embeddings
        if self.mode in FLOAT_LAYERS:
            _copy_rows(model.tok_emb.weight, embedding)
            if not tied:
                _copy_rows(model.lm_head.weight, self.source("output.weight"))
            return
        table = self._table(embedding)
        model.tok_emb = QuantizedEmbedding(table)
        output = table if tied else self._table(self.source("output.weight"))
        output.exact_largest = True
        model.lm_head = output

    def _table(self, source: _Source) -> QuantizedLinear:
        """The token table or output layer of ``source``, in the format an output layer takes."""
        return self.linear([source], self.format([source], output=True))

    def _fill_layer(self, layer: nn.Module, prefix: str) -> None:
        attention, ffn = layer.self_attn, layer.feed_forward
        for norm, name in ((layer.self_attn_norm, "attn_norm"), (layer.ffn_norm, "ffn_norm"),
                           (layer.self_attn_out_norm, "post_attention_norm"), (layer.ffn_out_norm, "post_ffw_norm"),
                           (attention.q_norm, "attn_q_norm"), (attention.k_norm, "attn_k_norm")):
            self.set_norm(norm, f"{prefix}.{name}.weight")
        qkv = self.qkv_sources(prefix)
        biases = [self.source(f"{prefix}.{n}.bias") for n in ("attn_q", "attn_k", "attn_v")] \
            if attention.q_proj.bias is not None else None  # Qwen2's
        out = [self.source(f"{prefix}.attn_output.weight")]
        if isinstance(ffn, MoEFeedForward):
            self._fill_experts(ffn, prefix)
        else:
            layer.feed_forward = self._feed_forward(ffn, self.gate_up_sources(prefix),
                                                    [self.source(f"{prefix}.ffn_down.weight")])
        if self.mode in FLOAT_LAYERS:
            for module, sources in ((attention.q_proj, qkv[:1]), (attention.k_proj, qkv[1:2]),
                                    (attention.v_proj, qkv[2:]), (attention.out_proj, out)):
                _copy_rows(module.weight, sources[0])
            for module, bias in zip((attention.q_proj, attention.k_proj, attention.v_proj), biases or (),
                                    strict=False):
                _copy_rows(module.bias[None], bias)
            return
        attention.out_proj = self.linear(out, self.format(out))
        stacked_qkv = self.linear(qkv, self.format(qkv), biases=biases)
        layer.self_attn = StackedSelfAttention.from_attention(attention, stacked_qkv)

    def _feed_forward(self, ffn: nn.Module, gate_up: list[_Source], down: list[_Source]) -> nn.Module:
        """A gated feed-forward network from its gate, up and down projections: float layers filled in place, or
        quantized layers with the gate and up projections stacked."""
        if self.mode in FLOAT_LAYERS:
            for module, source in ((ffn.gate, gate_up[0]), (ffn.up, gate_up[1]), (ffn.down, down[0])):
                _copy_rows(module.weight, source)
            return ffn
        ffn.down = self.linear(down, self.format(down))
        return StackedFeedForward.from_feed_forward(ffn, self.linear(gate_up, self.format(gate_up)))

    def _fill_experts(self, moe: MoEFeedForward, prefix: str) -> None:
        """A mixture of experts: each expert from its rows of the stored stacks (quantized as stored, or float),
        the router and a shared expert's gate in fp32 (see :func:`qkv.quantize.quantize`)."""
        _copy_rows(moe.router.proj.weight, self.source(f"{prefix}.ffn_gate_inp.weight"))
        for e, expert in enumerate(moe.experts):
            moe.experts[e] = self._feed_forward(expert, *self.expert_sources(prefix, e))
        if moe.shared is not None:
            _copy_rows(moe.shared_gate.weight, self.source(f"{prefix}.ffn_gate_inp_shexp.weight"))
            moe.shared = self._feed_forward(moe.shared, [self.source(f"{prefix}.ffn_{n}_shexp.weight")
                                                         for n in ("gate", "up")],
                                            [self.source(f"{prefix}.ffn_down_shexp.weight")])

    def linear(self, sources: list[_Source], fmt: str, *, biases: list[_Source] | None = None) -> QuantizedLinear:
        """One quantized layer whose rows are those of ``sources``, in order (and its bias ``biases``')."""
        inputs, rows = sources[0].inputs, sum(s.rows for s in sources)
        int8 = int8_class(inputs)
        repack = fmt == "int4" and all(s.kind in REPACKED for s in sources)
        as_blocks = fmt == "int8" and int8 is not Int8Linear and all(s.kind == "Q8_0" for s in sources)
        for source in sources:
            stored = repack or as_blocks or fmt in K_QUANTS.values()
            self.made[f"{source.kind} -> {fmt} {'as stored' if stored else 'quantized again'}"] += 1
        bias = biases is not None
        if fmt in K_QUANTS.values():
            layer = _k_quant_blocks(sources, inputs, rows, bias=bias)
        elif repack:
            layer = _repacked(sources, inputs, rows, bias=bias)
        elif as_blocks:
            layer = _q8_blocks(sources, inputs, rows, bias=bias)
        else:
            layer = int4_class(GROUP)(inputs, rows, group_size=GROUP, bias=bias) if fmt == "int4" else \
                int8(inputs, rows, bias=bias)
            offset = 0
            for source in sources:
                for start, values in source.chunks():
                    _encode_rows(layer, offset + start, values)
                offset += source.rows
        if bias:
            with torch.no_grad():
                layer.bias.copy_(torch.cat([_vector(b) for b in biases]))
        for source in sources:
            source.release()
        return layer


def _repacked(sources: list[_GGUFSource], inputs: int, rows: int, *, bias: bool) -> Int4Linear:
    """An int4 layer holding the 4-bit codes of ``sources`` as they are (see :mod:`qkv.interop.ggml_blocks`)."""
    layer = int4_class(GROUP)(inputs, rows, group_size=GROUP, bias=bias)
    offset = 0
    for source in sources:
        for start, end in source.spans():
            raw = source.raw(start, end)
            if hasattr(layer, "write_halves") and source.kind in ("Q4_0", "Q4_1"):  # the kernel's own blocks
                pairs, d, m = int4_halves(source.kind, raw)
                check_finite([(source.name, d), (source.name, m)], f"{source.path} holds",
                             "the file is damaged; use another copy")
                layer.write_halves(offset + start, pairs, d, m)
                continue
            pairs, scales, zeros = (torch.from_numpy(a) for a in int4_groups(source.kind, raw))
            check_finite([(source.name, scales), (source.name, zeros)], f"{source.path} holds",
                         "the file is damaged; use another copy")
            layer.write_pairs(offset + start, pairs, SPANS[source.kind], scales=scales, zeros=zeros)
        offset += source.rows
    return layer


def _q8_blocks(sources: list[_GGUFSource], inputs: int, rows: int, *, bias: bool) -> Int8Linear:
    """An int8 layer of qkv's kernel holding the Q8_0 blocks of ``sources`` as they are: codes and fp16 scales."""
    layer = int8_class(inputs)(inputs, rows, bias=bias)
    offset = 0
    for source in sources:
        for start, end in source.spans():
            codes, scales = int8_blocks(source.raw(start, end))
            check_finite([(source.name, scales)], f"{source.path} holds", "the file is damaged; use another copy")
            layer.write_rows(offset + start, codes, scales)
        offset += source.rows
    return layer


def holds_k_quants() -> bool:
    """Whether ``mode="auto"`` holds Q6_K and Q5_K blocks as stored: where qkv's kernel multiplies them with AVX-512
    (from memory as fast as int8 blocks, or within a fifth, for a quarter to a third less memory). With AVX2 or the
    portable C, unpacking them costs more than the bytes saved (1.3-1.4x an int8 block's time): they become int8
    blocks there, as with PyTorch's kernel (docs/quantization.md)."""
    from .. import kernels

    return int8_class(SUPER) is not Int8Linear and kernels.best_variant() == "avx512-vnni"


def _k_quant_blocks(sources: list[_GGUFSource], inputs: int, rows: int, *, bias: bool) -> QuantizedLinear:
    """A 6-bit or 5-bit layer of qkv's kernel holding the Q6_K or Q5_K blocks of ``sources`` as they are."""
    from ..kernel_layers import KernelInt5Linear, KernelInt6Linear

    six = sources[0].kind == "Q6_K"
    layer = (KernelInt6Linear if six else KernelInt5Linear)(inputs, rows, bias=bias)
    offset = 0
    for source in sources:
        for start, end in source.spans():
            raw = source.raw(start, end)
            blocks = q6_k_blocks(raw) if six else q5_k_blocks(raw)
            check_finite([(source.name, blocks[1])], f"{source.path} holds", "the file is damaged; use another copy")
            layer.write_blocks(offset + start, *blocks)
        offset += source.rows
    return layer


def _encode_rows(layer: QuantizedLinear, start: int, values: Tensor) -> None:
    """Rows ``start ...`` of ``layer`` encoded from their float32 ``values``: each row's codes and scales depend
    on that row alone, so a layer is encoded a chunk at a time."""
    if isinstance(layer, Int4Linear):
        layer.write_rows(start, **layer.encoded(values, layer.group_size))
    else:
        layer.write_rows(start, **layer.encoded(values))


def _copy_rows(weight: Tensor, source: _Source) -> None:
    with torch.no_grad():
        for start, values in source.chunks():
            weight[start : start + len(values)] = values.view(-1, weight.size(-1))
    source.release()


def _vector(source: _Source) -> Tensor:
    """A one-row tensor (a norm's gains, a bias), float32, checked finite."""
    return torch.cat([values for _, values in source.chunks()]).flatten()


__all__ = ["MODES", "load_quantized_gpt"]
