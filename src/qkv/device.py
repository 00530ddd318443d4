"""Where a model runs and in what precision, decided once, at the top (``--device``, ``--precision``).

    --device auto | cpu | cuda | cuda:N      auto: the first CUDA GPU when there is one, else the CPU
    --precision auto | fp32 | bf16 | fp16    auto: bf16 on a GPU that supports it; for training on a CPU with
                                             native bf16 (AMX or AVX512-BF16), bf16 when a measurement at
                                             start-up shows it faster (one process; the processes of a
                                             distributed CPU run train in fp32); else fp32

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
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .options import DEVICES, PRECISIONS

NATIVE_BF16 = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs that multiply bf16 in hardware
BF16_GAIN = 1.1  # bf16 is chosen for training on a CPU only when this much faster than fp32
NO_NATIVE_BF16 = "this CPU has no native bf16, where bf16 runs several times slower"  # the log's note, auto or asked


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
    why: str = ""  # how "auto" chose it, where that took a measurement or a look at the CPU (for the log)

    @property
    def needs_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16's and fp32's do not."""
        return self.dtype is torch.float16


def resolve_precision(name: str, device: torch.device, *, training: bool = False) -> Precision:
    """``--precision`` on ``device`` -> a :class:`Precision`. ``auto`` is bf16 on a GPU that has it; for
    ``training`` on a CPU, as :func:`cpu_training_precision` finds; fp32 otherwise.

    Raises:
        ValueError: for an unknown name, or fp16 anywhere but on a CUDA GPU.
    """
    if name not in PRECISIONS:
        raise ValueError(f"--precision {name!r} is not one of {', '.join(PRECISIONS)}")
    if name == "auto" and device.type == "cpu" and training:
        name, why = cpu_training_precision()
        return Precision(name, {"fp32": None, "bf16": torch.bfloat16}[name], why)
    if name == "auto":
        name = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ValueError(f"--precision fp16 needs a CUDA GPU (it trains with a gradient scaler); on {device.type} "
                         "use fp32 or bf16")
    return Precision(name, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name])


def native_bf16() -> str | None:
    """The flag of this CPU that multiplies bf16 in hardware (amx_bf16, avx512_bf16), or None (none, or not
    Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return next((flag for flag in NATIVE_BF16 if flag in flags), None)


def bf16_speedup(size: int = 512, repeats: int = 5) -> float:
    """How many times faster a (size × 2·size) · (2·size × 2·size) product runs under bf16 autocast than in fp32,
    on this CPU now: best of ``repeats`` each, after a warm-up (about a tenth of a second in all)."""
    a, b = torch.randn(size, 2 * size), torch.randn(2 * size, 2 * size)

    def best(bf16: bool) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            a @ b
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
        return min(times)

    return best(False) / best(True)


def cpu_training_precision() -> tuple[str, str]:
    """("bf16" or "fp32", why) for training on this CPU: bf16 only with native bf16, and only when a product
    measured now runs :data:`BF16_GAIN` times as fast in it."""
    flag = native_bf16()
    if flag is None:
        return "fp32", NO_NATIVE_BF16
    gain = bf16_speedup()
    return ("bf16" if gain >= BF16_GAIN else "fp32"), (f"this CPU has {flag}; a matrix product ran {gain:.2f}x as "
                                                        "fast in bf16; --precision fp32 or bf16 chooses")


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


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
LARGE_BLOCK = 256 << 10  # bytes


def map_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Have the C library's malloc map every block of ``threshold`` bytes or more on its own, and give it back to
    the system when it is freed; True where that took (glibc), False elsewhere (nothing changes).

    glibc keeps freed blocks in its heap for reuse, except those of at least its mapping threshold, which it
    raises (up to 32 MB) to the size of each mapped block freed. A training step frees activations of megabytes
    between the tensors it keeps (each layer's checkpointed input, the gradients), so its heap grows with holes
    that later steps cannot fill: QLoRA on a 1.7B model peaks some 500 MB higher than the memory it uses. A fixed
    threshold (which also stops it rising) keeps the peak near the memory used, for the time spent mapping fresh
    pages (15–20% of that model's QLoRA step on 2 cores).
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1


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
