"""Where a model runs and in what precision, decided once, at the top (``--device``, ``--precision``).

    --device auto | cpu | cuda | cuda:N      auto: the first CUDA GPU when there is one, else the CPU
    --precision auto | fp32 | bf16 | fp16    auto: bf16 on a GPU that supports it, else fp32

Mixed precision is autocast: weights and optimizer state stay fp32, matrix products run in bf16 or fp16, and
losses are computed in fp32 (the tasks cast the logits). fp16's narrow range needs the gradient scaler, so
it is for GPUs only; bf16 has fp32's range and needs none (on a CPU without AMX it is slower than fp32, see
the README). On a GPU, fp32 matrix products use TF32 tensor cores (10-bit mantissa; the tests state the
tolerance this costs).

Everything below the command line receives ``torch.device`` objects and a :class:`Precision`; blocks create
their tensors on the device of their inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

DEVICES = "auto, cpu, cuda or cuda:N"
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def resolve_device(name: str = "auto") -> torch.device:
    """``--device`` -> a ``torch.device``.

    Raises:
        ValueError: for an unknown device, CUDA asked for on a machine without it, or a GPU index that does
            not exist.
    """
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; give {DEVICES}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r} is not supported; give {DEVICES}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}); "
                             "use --device cpu or --device auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


@dataclass(frozen=True)
class Precision:
    """How matrix products are computed: ``dtype`` None means fp32 throughout (no autocast)."""

    name: str
    dtype: torch.dtype | None

    @property
    def needs_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16's and fp32's do not."""
        return self.dtype is torch.float16


def resolve_precision(name: str, device: torch.device) -> Precision:
    """``--precision`` on ``device`` -> a :class:`Precision`.

    Raises:
        ValueError: for an unknown name, or fp16 anywhere but on a CUDA GPU.
    """
    if name not in PRECISIONS:
        raise ValueError(f"--precision {name!r} is not one of {', '.join(PRECISIONS)}")
    if name == "auto":
        name = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ValueError(f"--precision fp16 needs a CUDA GPU (it trains with a gradient scaler); on {device.type} "
                         "use fp32 or bf16")
    return Precision(name, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name])


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager:
    """The one autocast context of a run, chosen from the device's type (nanoGPT's ``ctx``)."""
    if precision.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.dtype)


def prepare(device: torch.device) -> None:
    """Backend settings for a device, set once: TF32 matrix products and convolutions on CUDA GPUs."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory and without waiting, when it goes to a GPU."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def device_of(model: torch.nn.Module) -> torch.device:
    """The device a model's parameters are on."""
    return next(model.parameters()).device


def move(batch, device: torch.device):
    """A batch (a dataclass of tensors and counts) with every tensor on ``device``."""
    tensors = {f.name: to_device(value, device) for f in dataclasses.fields(batch)
               if isinstance(value := getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **tensors)
