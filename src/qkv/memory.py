"""Will it fit? A model's size is checked against the machine's memory before any of it is allocated.

A config is only numbers, so a typo (``d_ff: 1000000000000``) describes a model of terabytes; building it
would end in an allocator error deep inside PyTorch, or in the kernel killing the process. PyTorch's *meta*
device builds a model with shapes but no storage, in milliseconds whatever its size, so its parameters can be
counted first:

    bytes needed = parameters × 4 (fp32) × copies

with ``copies`` = 1 to use a model and 4 to train one (weights, gradients and AdamW's two moments).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

TRAINING_COPIES = 4  # weights, gradients, AdamW's first and second moments


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, bounded by a cgroup's limit; None if
    the system does not say."""
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


def _gib(n: float) -> str:
    return f"{n / 2**40:,.1f} TiB" if n >= 2**40 else f"{n / 2**30:,.1f} GiB"


def build_model(model_cls: type[nn.Module], config: Any, *, training: bool = False, what: str = "the model"
                ) -> nn.Module:
    """``model_cls(config)``, after checking that its parameters fit in memory.

    Args:
        model_cls: a qkv model class, built from its config alone.
        config: its config.
        training: count gradients and optimizer moments too.
        what: how the error names the model (e.g. the checkpoint's path).

    Raises:
        ValueError: if the model needs more memory than is available.
    """
    from .models.common import skip_init

    with torch.device("meta"), skip_init():  # no random numbers to draw: shapes only
        shapes = model_cls(config)
    n = sum(p.numel() for p in {id(p): p for p in shapes.parameters()}.values())
    copies = TRAINING_COPIES if training else 1
    need, have = 4 * n * copies, available_memory()
    if have is not None and need > have:
        use = "to train (weights, gradients and AdamW's moments, fp32)" if training else "for its weights (fp32)"
        raise ValueError(f"{what} has {n:,} parameters and needs {_gib(need)} {use}, more than the {_gib(have)} "
                         "of memory available; choose smaller sizes")
    return model_cls(config)
