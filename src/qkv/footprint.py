"""Memory footprints: will it fit? Sizes are checked against the machine's memory before any of it is allocated.

A config or an option is only a number, so a typo (``d_ff: 1000000000000``, ``--batch-size 1000000``) describes
terabytes; allocating them would end in an allocator error deep inside PyTorch, or in the kernel killing the
process. Each figure below is computed first and refused with a one-line ``ValueError`` that states it and the
memory available. They are estimates of the largest allocations (fp32, 4 bytes a number), not exact peaks.

* **The model.** PyTorch's *meta* device builds a model with shapes but no storage, so its parameters and
  buffers are counted exactly::

      bytes = 4 × parameters × copies + buffers

  with ``copies`` = 1 to use a model and 4 to train one (weights, gradients and AdamW's two moments). Two sizes
  are bounded from the config alone, before even that, because building on the meta device is not free for
  them: the layer count (at most :data:`MAX_LAYERS`; each layer takes about a millisecond to build, so 10^7 take
  hours) and a sinusoidal position table, which is computed on the CPU (``max_seq_len × d_model`` numbers, 16
  bytes each while it is made: float64, then float32).

* **One batch's activations**, for ``B`` sequences of ``T`` tokens through ``L`` layers of width ``d`` (``d_ff``
  in the feed-forward network, ``H`` heads each attending to ``K = min(T, window)`` keys, ``V`` output
  classes or tokens)::

      numbers = B·T·(L·(8·d + 2·d_ff) + 2·V) + B·H·T·K        (training: every layer's are kept for backward)
      numbers = B·T·(8·d + 2·d_ff + V) + B·H·T·K              (inference: one layer's at a time)
      numbers = B·T·(L·d + 8·d + 2·d_ff + 2·V) + B·H·T·K      (training, activation checkpointing: each layer's
                                                              input kept, one layer's recomputed at a time)

  ``8·d`` counts the queries, keys, values, attention output, two norms and two residual sums; ``2·d_ff`` the
  feed-forward hidden layer before and after its activation (``4·d_ff`` for a gated one, SwiGLU: the gate, the
  hidden layer, the gate's activation and the product); ``2·V`` the logits and their gradient; ``B·H·T·K``
  one layer's attention scores.

* **Fine-tuning** a model already loaded (:func:`check_training`): ``4 × 3 × P / N`` bytes for the gradients and
  AdamW's two moments of the ``P`` parameters that learn (``N`` processes sharing them under FSDP), and one
  batch's activations.

* **Images** padded by ``p`` pixels a side for augmentation: ``B·C·(S + 2p)²`` numbers for ``B`` images of
  ``C`` channels and side ``S``, counted with the batch.

* **Decoding** ``R`` rows (sentences × beams) to ``T`` tokens::

      numbers = R·(6·L·T·d + 3·V)

  every row's keys and values (``2·L·T·d``), three times over because a cache that outgrows its buffers moves
  to buffers twice as long (old and new side by side for a moment); and one step's logits, log-probabilities
  and scores.

The sizes are read from any family's config (:func:`stacks`): CLIP has two stacks; Swin counts all its layers
at its first stage's width and tokens (an over-estimate), with ``K`` its window; an LSTM's ``d`` is its hidden
size. Memory is the host's (MemAvailable, bounded by a cgroup's limit), or a CUDA device's free memory where the
caller names the device (decoding, encoding). A model and its training batch are checked against the host's
memory, where the model is built; a batch too large for a GPU still ends in the command line's one-line "out of
memory" error.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import GATED_ACTIVATIONS

TRAINING_COPIES = 4  # weights, gradients, AdamW's first and second moments
FLOAT = 4  # bytes of an fp32 number: every estimate counts fp32
SINUSOID_BYTES = 16  # a sinusoidal table's entry while it is made: float64, then its float32 copy
# Deeper than any published Transformer (DeepNet's 1,000 encoder + 1,000 decoder layers), and still seconds to
# build: the layer count is bounded because building even on the meta device takes about a millisecond a layer.
MAX_LAYERS = 4096


def available_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes this process may still allocate on ``device`` (the host when None or a CPU): the kernel's
    MemAvailable bounded by a cgroup's limit, or a GPU's free memory; None if the system does not say."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # a container's limit (cgroup v2)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            candidates.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return max(0, min(candidates))


def return_freed_memory() -> None:
    """Hand the pages of memory freed inside the C heap back to the system (glibc's ``malloc_trim``; nothing where
    the C library has none). Building a large model a layer at a time frees many temporaries between the layers'
    buffers; glibc keeps their pages, and a 17 GB file's model peaked 4 GB above its own size until the loader
    called this after each layer."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


KEPT_BELOW = 32 << 20  # blocks under this size come from the C heap, whose freed memory is kept (reuse_freed_memory)


def reuse_freed_memory() -> None:
    """Keep the memory a training step frees for the next step (glibc's ``mallopt``; nothing elsewhere).

    A step allocates and frees the same activations every time, blocks of a few hundred kilobytes to a few megabytes.
    By default glibc gives such blocks their own mappings, or hands the top of its heap back to the system once
    enough of it is free, so every step asks for fresh pages and touches each one first: about 1,500 page faults a
    step at nanoGPT's CPU configuration, and 8% of its time (2 cores of an AMD EPYC; ``docs/benchmarks.md``). With
    blocks under :data:`KEPT_BELOW` from the heap and its top kept, a step reuses the last one's pages; the memory
    held is the peak a step needs, which it holds anyway. :func:`return_freed_memory` still hands pages back when
    asked (the loader does, between layers)."""
    library = libc()
    if library is not None and hasattr(library, "mallopt"):
        library.mallopt(_M_MMAP_THRESHOLD, KEPT_BELOW)
        library.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def libc():
    """The C library (None where it cannot be loaded): its allocator's and the system's calls."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _malloc_trim():
    library = libc()
    return getattr(library, "malloc_trim", None) if library is not None else None


def _gib(n: float) -> str:
    return f"{n / 2**40:,.1f} TiB" if n >= 2**40 else f"{n / 2**30:,.1f} GiB"


def check_fits(need: int, what: str, purpose: str = "", *, device: torch.device | str | None = None) -> None:
    """Refuse ``need`` bytes that ``device`` (the host by default) does not have.

    Args:
        need: bytes about to be allocated.
        what: what needs them, the sentence's subject (``"the model of run/config.json"``).
        purpose: what for, after the figure (``" to decode 8 rows"``).
        device: where they would be allocated.

    Raises:
        ValueError: "WHAT needs FIGURE PURPOSE, more than the MEMORY of memory available; choose smaller sizes".
    """
    have = available_memory(device)
    if have is not None and need > have:
        where = f" on {device}" if device is not None and torch.device(device).type != "cpu" else ""
        raise ValueError(f"{what} needs {_gib(need)}{purpose}, more than the {_gib(have)} of memory "
                         f"available{where}; choose smaller sizes")


@dataclass(frozen=True)
class Stack:
    """The sizes of one stack of layers that the estimates use, read from a config of any family."""

    d: int  # token width
    d_ff: int  # feed-forward hidden width
    layers: int
    heads: int
    outputs: int  # vocabulary (or classes): the logits' width
    tokens: int  # longest sequence: max_seq_len, or patches (+1) for images
    keys: int  # keys each query attends to
    sinusoid_rows: int  # rows of a sinusoidal position table (0: none)
    gated: bool = False  # a gated feed-forward network (SwiGLU): gate, up, their activation and product kept


def _layer_count(c: Any) -> int:
    if getattr(c, "depths", None) is not None:  # Swin: layers per stage
        return sum(c.depths)
    if hasattr(c, "n_encoder_layers"):  # the encoder-decoder: each side may override n_layers
        return (c.n_encoder_layers or c.n_layers) + (c.n_decoder_layers or c.n_layers)
    return c.n_layers


def stacks(config: Any) -> list[Stack]:
    """One :class:`Stack` per model in ``config`` (CLIP has two: vision and text)."""
    if hasattr(config, "vision") and hasattr(config, "text"):
        return stacks(config.vision) + stacks(config.text)
    d = getattr(config, "d_model", None) or config.hidden_size  # an RNN: its hidden state
    outputs = max(getattr(config, name, None) or 0 for name in
                  ("vocab_size", "src_vocab_size", "tgt_vocab_size", "n_classes", "n_labels"))
    if hasattr(config, "image_size"):
        tokens = (config.image_size // config.patch_size) ** 2 + 1
    else:
        tokens = getattr(config, "max_seq_len", 0)
    window = getattr(config, "window_size", None)
    window = window * window if window else getattr(config, "window", None)
    heads = max(getattr(config, "stage_heads", None) or (getattr(config, "n_heads", 1),))
    return [Stack(d=d, d_ff=getattr(config, "d_ff", None) or 4 * d, layers=_layer_count(config), heads=heads,
                  outputs=outputs, tokens=tokens, keys=min(tokens, window or tokens),
                  sinusoid_rows=tokens if getattr(config, "positional", None) == "sinusoidal" else 0,
                  gated=getattr(config, "activation", None) in GATED_ACTIVATIONS)]


def _check_config(config: Any, what: str) -> None:
    """What building on the meta device would itself spend: time per layer, a sinusoidal table's memory."""
    for s in stacks(config):
        if s.layers > MAX_LAYERS:
            raise ValueError(f"{what} has {s.layers:,} layers; qkv builds at most {MAX_LAYERS:,} (the deepest "
                             "published Transformers have about 1,000 a side); choose fewer layers")
        check_fits(SINUSOID_BYTES * s.sinusoid_rows * s.d,
                   f"the position table of {what} (max_seq_len {s.sinusoid_rows:,} × d_model {s.d:,})")


def activation_bytes(config: Any, batch: int, length: int | None = None, *, training: bool,
                     checkpointing: bool = False) -> int:
    """Bytes of one batch's activations (the module text gives the formula): ``batch`` sequences of ``length``
    tokens (the config's longest by default). With activation ``checkpointing`` a training step keeps each
    layer's input and one layer's activations at a time."""
    total = 0
    for s in stacks(config):
        t = s.tokens if length is None else min(length, s.tokens or length)
        layer = 8 * s.d + (4 if s.gated else 2) * s.d_ff
        kept = s.layers * s.d + layer if checkpointing else s.layers * layer
        per_token = kept + 2 * s.outputs if training else layer + s.outputs
        total += batch * t * per_token + batch * s.heads * t * min(t, s.keys or t)
    return FLOAT * total


def decoding_bytes(config: Any, rows: int, length: int) -> int:
    """Bytes to decode ``rows`` sequences (sentences × beams) to ``length`` tokens: key/value caches and one
    step's logits (the module text gives the formula)."""
    return FLOAT * sum(rows * (6 * s.layers * length * s.d + 3 * s.outputs) for s in stacks(config))


def check_decoding(config: Any, *, sequences: int, beams: int, length: int,
                   device: torch.device | str | None = None) -> None:
    """Refuse to decode ``sequences`` × ``beams`` rows to ``length`` tokens when their caches would not fit.

    Raises:
        ValueError: naming the sizes, the figure and the memory available.
    """
    what = f"decoding {sequences:,} sequence(s) with {beams:,} beam(s) each to {length:,} tokens"
    check_fits(decoding_bytes(config, sequences * beams, length), what, device=device)


def padded_images(batch: int, config: Any, pad: int) -> int:
    """Numbers in a batch of images padded by ``pad`` pixels on every side (augmentation pads, then crops)."""
    return batch * config.channels * (config.image_size + 2 * pad) ** 2


def check_model(model_cls: type[nn.Module], config: Any, *, training: bool = False, what: str = "the model",
                batch: tuple[int, int | None] | None = None, inputs: int = 0) -> None:
    """Check that ``model_cls(config)`` fits in memory (and, given ``batch``, one batch too), without building it.

    Args:
        model_cls: a qkv model class, built from its config alone.
        config: its config.
        training: count gradients and optimizer moments too, and keep every layer's activations.
        what: how the error names the model (e.g. the checkpoint's path).
        batch: ``(sequences, tokens)`` of one batch (tokens None: the config's longest), to count its
            activations with the model's memory.
        inputs: numbers in one batch's inputs beyond its tokens (e.g. images padded for augmentation).

    Raises:
        ValueError: if the model (with its batch) needs more memory than is available, or has more layers than
            :data:`MAX_LAYERS`.
    """
    from .models.common import skip_init

    _check_config(config, what)
    with torch.device("meta"), skip_init():  # no random numbers to draw: shapes only
        shapes = model_cls(config)
    n = sum(p.numel() for p in {id(p): p for p in shapes.parameters()}.values())
    buffers = sum(b.numel() * b.element_size() for b in shapes.buffers())
    need = FLOAT * n * (TRAINING_COPIES if training else 1) + buffers
    use = " to train (weights, gradients and AdamW's moments, fp32)" if training else " for its weights (fp32)"
    if batch is not None:
        need += activation_bytes(config, *batch, training=training) + FLOAT * inputs
        use += f" and one batch of {batch[0]:,}" + (f" × {batch[1]:,} tokens" if batch[1] else "")
    check_fits(need, f"{what} has {n:,} parameters and", use)


def check_training(model: nn.Module, *, batch: int, length: int, checkpointing: bool, shards: int = 1,
                   what: str = "training") -> None:
    """Refuse to train ``model`` (already in memory) when its gradients, AdamW's two moments (of the parameters
    that learn, ``shards`` processes sharing them) and one batch's activations would not fit beside it.

    Raises:
        ValueError: naming the sizes, the figure and the memory available.
    """
    learn = sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = FLOAT * learn * (TRAINING_COPIES - 1) // shards
    need += activation_bytes(model.config, batch, length, training=True, checkpointing=checkpointing)
    check_fits(need, f"{what} ({learn:,} parameters learn)",
               f" for gradients, AdamW's moments and one batch of {batch:,} × {length:,} tokens")


def build_model(model_cls: type[nn.Module], config: Any, *, initialise: bool = True, **check: Any) -> nn.Module:
    """``model_cls(config)``, after :func:`check_model` (``check`` are its keyword arguments).

    Args:
        model_cls: a qkv model class, built from its config alone.
        config: its config.
        initialise: draw the initial weights; False leaves them uninitialised, for weights loaded next.

    Raises:
        ValueError: as :func:`check_model` does.
    """
    from .models.common import skip_init

    check_model(model_cls, config, **check)
    with contextlib.nullcontext() if initialise else skip_init():
        return model_cls(config)
