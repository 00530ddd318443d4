"""How many threads a model runs on: the cores this process may use, less those other programs keep busy.

A matrix product (PyTorch's, or qkv's kernel, which runs on PyTorch's OpenMP threads) splits its rows over the
threads, and every thread waits for the last one to finish before the next product begins. Waiting threads spin,
which is what makes a quiet machine fast (a step of SmolLM2-135M is hundreds of products of a few microseconds
each, and a sleeping thread takes longer than that to wake). On a machine where another program keeps a core busy
the same spinning collapses decoding: the thread that shares that core runs only in the time slices the scheduler
gives it, and the others spin until it does. Measured on 2 cores, ``qkv generate --pretrained smollm2`` decoding
(tokens/s, ``benchmarks/bench_generate.py --busy``):

    ===================  =====  ================================
    threads              quiet  one CPU-bound program beside it
    ===================  =====  ================================
    2 (spinning)          73.4  21.5
    2 (OMP_WAIT_POLICY=   38.3  55.3
    PASSIVE: sleeping)
    1                     58.0  61.5
    ===================  =====  ================================

So a command that runs a model takes ``--threads N`` (llama.cpp's ``-t``), and by default as many threads as the
cores it may use (``os.sched_getaffinity``) that other programs left idle, measured from ``/proc/stat`` over the
time since the command started (its own CPU time taken out), at least one.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("qkv")

MIN_SECONDS = 0.1  # the shortest time the idle cores are measured over (a sleep makes up the rest)


def usable() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _snapshot() -> tuple[float, float, float] | None:
    """(monotonic seconds, busy seconds of the cores this process may use, this process's CPU seconds), or None
    where ``/proc/stat`` cannot be read."""
    try:
        cores = os.sched_getaffinity(0)
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except (AttributeError, OSError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
    own = os.times()
    return time.monotonic(), busy / tick, own.user + own.system


_START = _snapshot()  # when qkv's command line was read: the start of the time measured


def others_busy() -> float:
    """How many of this process's cores other programs kept busy since it started (0 where it cannot be told)."""
    start = _START
    if start is None:
        return 0.0
    if time.monotonic() - start[0] < MIN_SECONDS:
        time.sleep(MIN_SECONDS - (time.monotonic() - start[0]))
    end = _snapshot()
    if end is None:
        return 0.0
    seconds = end[0] - start[0]
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / seconds


def default() -> int:
    """The cores this process may use that other programs left idle, at least one."""
    return max(1, min(usable(), round(usable() - others_busy())))


def use(threads: int | None) -> int:
    """Run PyTorch (and qkv's kernel) on ``threads`` threads (None: :func:`default`; the debug log says when other
    programs leave fewer cores than this process may use); the number used."""
    import torch

    n = default() if threads is None else threads
    if threads is None and n < usable():
        log.debug("%d of %d cores: other programs keep the rest busy (--threads N sets it)", n, usable())
    torch.set_num_threads(n)
    return n


__all__ = ["default", "others_busy", "usable", "use"]
