"""Training in several processes with PyTorch's own engine: ``torchrun`` starts them,
``DistributedDataParallel`` keeps their models equal.

    torchrun --nproc_per_node 2 -m qkv.cli train lm --text input.txt --out runs/lm     # 2 processes, 1 machine

Each process (a *rank*) builds the same model and the same list of batches (both follow the seed), then at
every step takes its own contiguous share of the step's batches: the global batch is the same as one process
accumulating ``accum × world`` batches, and the loss is normalised by the tokens of all of them, so the two
follow the same curve. DDP averages the gradients during the backward pass (only on a step's last
micro-batch); validation is split across the ranks and its sums gathered; rank 0 alone writes checkpoints,
logs, plots and progress, and decides when to evaluate and when to stop, so every rank does the same.

NCCL connects GPUs, Gloo CPUs. Without torchrun's environment everything here is the single process
:data:`SINGLE`, and the same code runs. A rank that finds no rank 0 (``RANK=1`` started by hand) gives up after
60 seconds (``QKV_RENDEZVOUS_TIMEOUT``) and says what is missing, instead of waiting for ever.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RENDEZVOUS_TIMEOUT_S = 60.0  # how long a rank waits for rank 0's store to answer (QKV_RENDEZVOUS_TIMEOUT overrides)


@dataclass(frozen=True)
class Group:
    """This process's place among the processes of a run (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0, the one that writes."""
        return self.rank == 0

    def shard(self, items: Sequence) -> Sequence:
        """This rank's contiguous share of ``items`` (shares differ in size by at most one; in rank order they
        are ``items`` again, so gathered results keep the original order)."""
        n = len(items)
        return items[self.rank * n // self.world : (self.rank + 1) * n // self.world]

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Every rank's ``values`` added up, on every rank."""
        if self.world == 1:
            return values
        keys = sorted(values)
        total = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist(), strict=True))

    def gather(self, items: list) -> list:
        """Every rank's ``items`` concatenated in rank order, on every rank."""
        if self.world == 1:
            return items
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, items)
        return [item for part in parts for item in part]

    def decide(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank: decisions that depend on a clock or a signal are made once."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


SINGLE = Group()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def setup(device_type: str) -> Group:
    """Join the process group that torchrun describes in the environment (once per process): NCCL for CUDA,
    Gloo for the CPU. Without torchrun's variables, the single process.

    Raises:
        ValueError: if the environment is inconsistent (some of torchrun's variables but not all, a rank
            outside the world).
        ConnectionError: if rank 0 does not answer within the rendezvous timeout (see :func:`_wait_for_rank_0`).
    """
    present = {name: os.environ.get(name) for name in ENV}
    if all(value is None for value in present.values()):
        return SINGLE
    missing = [name for name, value in present.items() if value is None]
    if missing:
        raise ValueError(f"torchrun's environment is incomplete ({', '.join(missing)} not set); start qkv with "
                         "torchrun --nproc_per_node N -m qkv.cli ..., or unset RANK/WORLD_SIZE for one process")
    try:
        rank, world, local = (int(present[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise ValueError(f"torchrun's RANK, WORLD_SIZE and LOCAL_RANK must be integers, got {present}") from None
    if not (0 <= rank < world and 0 <= local < world):
        raise ValueError(f"RANK={rank} and LOCAL_RANK={local} must lie in [0, WORLD_SIZE={world})")
    if world == 1:
        return SINGLE
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local)
        if rank != 0:
            _wait_for_rank_0(present["MASTER_ADDR"], present["MASTER_PORT"], world)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        # left before the interpreter's teardown: a group still alive then may abort the process as its threads
        # are destroyed ("terminate called without an active exception"), after a run that went well
        atexit.register(dist.destroy_process_group)
    return Group(rank, world, local)


def _rendezvous_timeout() -> float:
    value = os.environ.get("QKV_RENDEZVOUS_TIMEOUT", str(RENDEZVOUS_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"QKV_RENDEZVOUS_TIMEOUT must be a number of seconds > 0, got {value!r}")
    return seconds


def _wait_for_rank_0(address: str, port: str, world: int) -> None:
    """Wait, for a bounded time, until the store at MASTER_ADDR:MASTER_PORT (rank 0's, or torchrun's) accepts a
    connection; init_process_group then joins it.

    init_process_group's own timeout would bound this wait too, but it is also every collective's: a short one
    would end a run whose rank 0 takes a while to save a checkpoint. A plain socket is tried, not a TCPStore
    client, whose failed attempts print C++ stack traces.
    """
    seconds = _rendezvous_timeout()
    try:
        port_number = int(port)
    except ValueError:
        raise ValueError(f"MASTER_PORT must be a port number, got {port!r}") from None
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((address, port_number), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"no rank 0 answered at {address}:{port} within {seconds:g} s: start all {world} "
                                      f"processes with torchrun --nproc_per_node {world} -m qkv.cli ...") from None
            time.sleep(0.2)  # rank 0 may not be listening yet: torchrun starts the processes together


def current() -> Group:
    """The group this process has joined (:data:`SINGLE` if none)."""
    if not dist.is_initialized():
        return SINGLE
    return Group(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
