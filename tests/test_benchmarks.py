"""The training-step benchmark's contenders still run against today's API: one step of each, smallest sizes.
(The benchmarks time nothing here; they are programs for a quiet machine.)"""

import importlib.util
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_training_step_contender_takes_a_step():
    bench = load("bench_train_step")
    stream = torch.randint(0, bench.VOCAB, (5_000,))
    for step in (bench.reference_step(stream, compiled=False), bench.qkv_step(stream, compiled=False),
                 bench.translation_step("fp32", dropout=0.0, batch=2, length=4, vocab=64)):
        step()
