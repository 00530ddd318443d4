"""Quantizing a model: each linear layer replaced by a weight-only int8 or int4 one (:mod:`qkv.quantized`, where the
formats and their formula are), held by qkv's own kernel where it is built (:mod:`qkv.kernel_layers`) and by
PyTorch's otherwise; the output layer int8 in every mode, the inputs of largest magnitude kept in fp32 (outlier
columns, found by :func:`input_magnitudes` on a calibration text), and the projections that read the same input
stacked into one layer first (:func:`stack_projections`).

``QKV_KERNEL`` chooses the kernel (:func:`qkv.kernels.choice` reads it): ``auto`` (the default: qkv's wherever it is
built), ``qkv``, one of its variants by name, or ``torch``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from . import kernels
from .kernel_layers import KernelInt4Linear, KernelInt8Linear
from .nn.attention import StackedSelfAttention
from .nn.feedforward import FeedForward, StackedFeedForward
from .nn.layers import DecoderLayer, EncoderLayer
from .nn.linear import FloatLinear
from .options import DEFAULT_GROUP_SIZE, MODES
from .quantized import FORMATS, Int4Linear, Int8Linear, QuantizedLinear, check_int4

log = logging.getLogger(__name__)


DEFAULT_OUTLIERS = 16
# Text for input_magnitudes: everyday sentences of several kinds, written for qkv (none from the benchmarks' data).
CALIBRATION_TEXT = (
    "A man in a red jacket is walking his dog along the beach.",
    "Two children are playing football in a park on a sunny afternoon.",
    "Where is the nearest train station, and how long does it take to get there?",
    "The meeting has been moved to Thursday at three o'clock because the manager is travelling.",
    "Preheat the oven to 180 degrees, then mix the flour, sugar and butter in a large bowl.",
    "The company reported a ten percent rise in profits for the second quarter of the year.",
    "She opened the window and listened to the rain falling on the roofs of the old town.",
    "To install the package, run the command below and restart your computer when it finishes.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The patient was given antibiotics and should recover within a week.",
    "I can't believe how quickly this year has gone by!",
    "A group of tourists takes pictures in front of a large stone cathedral.",
    "The function returns a sorted list of the unique values found in the input array.",
    "Heavy snow closed several roads in the mountains overnight, and schools stayed shut.",
    "Could you recommend a good book about the history of mathematics?",
    "The orchestra played Beethoven's ninth symphony to a sold-out hall.",
    "A woman is cutting vegetables in a small kitchen while a pot boils on the stove.",
    "Scientists have discovered a new species of frog in the rainforests of South America.",
    "Please send me the report by Friday so that I can review it before the conference.",
    "The river flows through three countries before it reaches the sea.",
    "He forgot his umbrella again, so he arrived at work soaking wet.",
    "The new phone has a larger screen, a faster processor and a battery that lasts two days.",
    "Elections will be held in the spring, and the polls suggest a close race.",
    "A cat sleeps on a wooden chair next to a window full of plants.",
)


def _kernel_layers() -> bool:
    """Whether quantized layers multiply with qkv's own kernel (:mod:`qkv.kernels`) here. The environment's
    ``QKV_KERNEL`` chooses: ``qkv``, ``torch`` (PyTorch's kernels), or ``auto`` (the default): qkv's wherever it is
    built, as it is faster than PyTorch's on every CPU measured (AVX2 and AVX-512, docs/quantization.md) and holds
    a GGUF file's blocks as stored; or one of qkv's variants by name (``portable``, ``avx2``, ``avx512-vnni``:
    :func:`qkv.kernels.best_variant`), as :func:`qkv.kernels.choice` reads it."""
    if kernels.choice() == "torch":
        return False
    if not kernels.available():
        _say_once(f"{kernels.why_not()}; quantized layers multiply with PyTorch's kernels")
        return False
    return True


def int4_class(group_size: int = DEFAULT_GROUP_SIZE) -> type[Int4Linear]:
    """The int4 layer for groups of ``group_size``: qkv's kernel's (:class:`~qkv.kernel_layers.KernelInt4Linear`)
    for groups of its 32 inputs where :func:`_kernel_layers` says so, else :class:`Int4Linear` on PyTorch's."""
    if group_size != kernels.BLOCK or not _kernel_layers():
        return Int4Linear
    return KernelInt4Linear


def int8_class(in_features: int) -> type[Int8Linear]:
    """The int8 layer for ``in_features`` inputs: qkv's kernel's (:class:`~qkv.kernel_layers.KernelInt8Linear`,
    a scale per 32 inputs) where :func:`_kernel_layers` says so and the inputs are whole blocks of 32, else
    :class:`Int8Linear` (a scale per row) on PyTorch's."""
    if in_features % kernels.BLOCK or not _kernel_layers():
        return Int8Linear
    return KernelInt8Linear


@functools.cache
def _say_once(message: str) -> None:
    log.info("%s", message)




def quantize_linear(linear: nn.Linear, mode: str, *, group_size: int = DEFAULT_GROUP_SIZE,
                    outlier_columns: Tensor | None = None) -> QuantizedLinear:
    """``linear`` quantized to ``mode`` (a format of :data:`FORMATS`), its ``outlier_columns`` kept in fp32;
    ``group_size`` is int4's (int8 has one scale a row).

    Raises:
        ValueError: an unknown mode, or an int4 group size that does not fit the layer.
    """
    if mode not in FORMATS:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(FORMATS)}")
    if mode == "int4":
        return int4_class(group_size).from_linear(linear, outlier_columns=outlier_columns, group_size=group_size)
    return int8_class(linear.in_features).from_linear(linear, outlier_columns=outlier_columns)


@torch.no_grad()
def input_magnitudes(model: nn.Module, run: Callable[[], object]) -> dict[str, Tensor]:
    """Each ``nn.Linear``'s mean ``|x_i|`` per input channel ``(in_features,)``, by layer name, over every
    position of the inputs it saw while ``run()`` ran ``model`` (on calibration text)."""
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}

    def record(name: str, inputs: tuple[Tensor, ...]) -> None:
        x = inputs[0].detach().float().reshape(-1, inputs[0].size(-1))
        sums[name] = sums.get(name, 0) + x.abs().sum(dim=0).cpu()
        counts[name] = counts.get(name, 0) + x.size(0)

    hooks = [m.register_forward_pre_hook(lambda _m, inputs, name=name: record(name, inputs))
             for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return {name: total / counts[name] for name, total in sums.items()}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def stack_projections(model: nn.Module) -> dict[str, str]:
    """Build each self-attention of an encoder or decoder layer again as a :class:`~qkv.nn.StackedSelfAttention`
    (W^Q, W^K, W^V as one layer) and each gated feed-forward as a :class:`~qkv.nn.StackedFeedForward` (W_g and W_1
    as one), in ``model`` (in place; layers already quantized or stacked are left as they are). Returns, for each
    stacked layer's name, the name of a layer it replaced: they read the same input."""
    replaced = {}
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        if isinstance(module, (EncoderLayer, DecoderLayer)):
            attention = StackedSelfAttention.from_attention(module.self_attn)
            if attention is not None:
                module.self_attn = attention
                replaced[f"{prefix}self_attn.qkv_proj"] = f"{prefix}self_attn.q_proj"
        elif isinstance(module, FeedForward) and name:  # (a model that is one feed-forward is left as it is)
            ffn = StackedFeedForward.from_feed_forward(module)
            if ffn is not None:
                _set_submodule(model, name, ffn)
                replaced[f"{prefix}gate_up"] = f"{prefix}gate"
    return replaced


def float_layers(model: nn.Module) -> nn.Module:
    """``model`` (in place) held to decode in float32 on a CPU: its self-attentions' and gated feed-forwards'
    projections stacked (:func:`stack_projections`), and every plain ``nn.Linear`` a
    :class:`~qkv.nn.linear.FloatLinear`, whose products of a decoding step's few rows run on all threads. The same
    weights; the same numbers to float rounding."""
    stack_projections(model)
    for module in model.modules():
        if type(module) is nn.Linear:
            FloatLinear.adopt(module)
    return model


def _routes(name: str) -> bool:
    """A mixture of experts' router (or its shared expert's gate): kept in fp32, for its logits choose the experts,
    and a choice flipped by rounding costs more than its few weights (E x d_model) would save."""
    return name.endswith(("router.proj", "shared_gate"))


def quantize(model: nn.Module, mode: str, *, group_size: int = DEFAULT_GROUP_SIZE,
             magnitudes: dict[str, Tensor] | None = None, outliers: int = DEFAULT_OUTLIERS) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`QuantizedLinear` of format ``mode``
    (:data:`FORMATS`); returns the model.

    ``mode`` "none" leaves it as it is. Otherwise self-attention's Q, K, V projections and a gated feed-forward's
    gate and up projections are first stacked into one layer each (:func:`stack_projections`: the same numbers,
    fewer products a decoding step). With ``magnitudes`` (from :func:`input_magnitudes` on the model as it was
    given), each layer found there keeps the ``outliers`` input columns with the largest inputs in fp32 (see the
    module's text). Every layer is checked before any is replaced, so a width that does not fit the group size
    leaves the model untouched.

    Raises:
        ValueError: an unknown mode, or an int4 group size that does not divide a layer's width.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return model
    output = getattr(model, "output_layer", None)
    if mode == "int4":
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name != output and not _routes(name):
                check_int4(name, m.in_features, group_size)
    replaced = stack_projections(model)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and not _routes(name)]
    for name, linear in linears:
        layer_mode = "int8" if mode == "int4" and name == output else mode
        columns = None
        source = replaced.get(name, name)
        if magnitudes is not None and source in magnitudes and outliers:
            columns = magnitudes[source].topk(min(outliers, linear.in_features)).indices.sort().values
        layer = quantize_linear(linear, layer_mode, group_size=group_size, outlier_columns=columns)
        layer.exact_largest = name == output  # greedy decoding's choice, as fp32 weights would make it
        _set_submodule(model, name, layer)
    return model


__all__ = ["CALIBRATION_TEXT", "DEFAULT_OUTLIERS", "float_layers", "input_magnitudes", "int4_class", "int8_class",
           "quantize", "quantize_linear", "stack_projections"]
