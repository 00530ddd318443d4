"""Where and how a training run computes: its device, its precision and its process group, resolved once.

    runtime = Runtime.resolve("auto", "auto")   # --device, --precision -> Runtime(device, precision, group)
    Trainer(task, opts, runtime=runtime)

A command resolves its runtime first, before it reads data (a device this machine lacks is said at once), and
hands the same object to everything after it; the trainer resolves its own only when a library caller gives it
none (from ``TrainOptions.device`` and ``.precision``). Under torchrun, resolving joins the process group (see
:mod:`qkv.distributed`) and gives each process its own GPU, ``cuda:LOCAL_RANK``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import distributed
from .device import Precision, autocast, prepare, resolve_device, resolve_precision
from .distributed import SINGLE, Group

# --precision auto for the processes of a distributed CPU run: one choice that needs no measurement (each process's
# own could differ, and processes that compute in different precisions drift apart).
DISTRIBUTED_CPU = Precision("fp32", None, "a distributed CPU run: its processes would each time bf16 on their own; "
                            "--precision bf16 chooses it for all")


@dataclass(frozen=True)
class Runtime:
    """The device a run computes on, in what precision, and this process's place among the run's processes."""

    device: torch.device
    precision: Precision
    group: Group = SINGLE

    @classmethod
    def resolve(cls, device: str = "auto", precision: str = "auto", *, training: bool = False) -> Runtime:
        """``--device`` and ``--precision`` -> a runtime: both checked before a process group is joined (a bad
        option fails at once, not after the rendezvous), the group joined (once per process), one GPU per process
        in a distributed run, and the device's backend settings made (:func:`qkv.device.prepare`). ``training``:
        ``auto`` precision on a CPU may choose bf16 (see :func:`qkv.device.resolve_precision`).

        Raises:
            ValueError: for a device or precision this machine cannot give (see :mod:`qkv.device`), or an
                inconsistent torchrun environment (see :func:`qkv.distributed.setup`).
        """
        where = resolve_device(device)
        how = resolve_precision(precision, where, training=training)
        group = distributed.setup(where.type)
        if where.type == "cuda" and group.world > 1:
            where = torch.device("cuda", group.local_rank)  # one GPU per process
            how = resolve_precision(precision, where, training=training)  # "auto" asks this process's GPU
        elif group.world > 1 and precision == "auto" and how.name != "fp32":
            how = DISTRIBUTED_CPU  # each process measured on its own: they could have chosen apart
        prepare(where)
        return cls(where, how, group)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's one autocast context (:func:`qkv.device.autocast`)."""
        return autocast(self.device, self.precision)
