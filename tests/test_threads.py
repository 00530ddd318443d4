"""How many threads a command runs a model on (``qkv.threads``): the cores this process may use less those other
programs keep busy, at least one; ``--threads N`` as given; a bad count refused in one line."""

from __future__ import annotations

import subprocess
import sys
import time

import torch
from clitools import ok, one_line_error, qkv

from qkv import threads


def test_the_count_is_the_idle_cores_at_least_one(monkeypatch):
    snapshots = iter([(0.0, 500.0, 2.0), (1.0, 501.5, 2.5)])  # 1 s: 1.5 cores busy, 0.5 of it this process's own
    monkeypatch.setattr(threads, "_START", next(snapshots))
    monkeypatch.setattr(threads, "_snapshot", lambda: next(snapshots))
    monkeypatch.setattr(threads, "usable", lambda: 4)
    assert threads.others_busy() == 1.0
    for busy, expected in ((0.0, 4), (1.2, 3), (2.6, 1), (3.9, 1), (9.0, 1)):
        monkeypatch.setattr(threads, "others_busy", lambda busy=busy: busy)
        assert threads.default() == expected


def test_cores_kept_busy_by_other_programs_are_left_to_them(monkeypatch):
    """With a CPU-bound process on every core, one thread is all that is idle: measured, not assumed."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(threads.usable())]
    try:
        time.sleep(0.2)  # they are running
        monkeypatch.setattr(threads, "_START", threads._snapshot())
        assert threads.others_busy() > threads.usable() - 0.5
        assert threads.default() == 1
    finally:
        for spinner in spinners:
            spinner.kill()


def test_use_sets_pytorchs_threads():
    before = torch.get_num_threads()
    try:
        assert threads.use(3) == 3 and torch.get_num_threads() == 3
        assert 1 <= threads.use(None) <= threads.usable()
    finally:
        torch.set_num_threads(before)


def test_the_command_takes_threads(cli_work, lm_run):
    ok(qkv("generate", "--model", lm_run, "--prompt", "ab", "--max-new-tokens", "3", "--threads", "1", cwd=cli_work))
    one_line_error(qkv("generate", "--model", lm_run, "--prompt", "ab", "--threads", "0", cwd=cli_work),
                   "--threads")
