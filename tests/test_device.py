"""--precision auto: fp32 on a CPU unless it has native bf16 and a measurement shows bf16 faster, for training
only; the choice said on stderr."""

import logging
import math

import pytest
import torch

from qkv import device as dev


def test_auto_is_fp32_for_inference_on_a_cpu_whatever_it_has(monkeypatch):
    monkeypatch.setattr(dev, "native_bf16", lambda: "amx_bf16")
    monkeypatch.setattr(dev, "bf16_speedup", lambda: 3.0)
    assert dev.resolve_precision("auto", torch.device("cpu")).name == "fp32"


@pytest.mark.parametrize(("flag", "gain", "chosen", "said"), [
    (None, None, "fp32", "has no native bf16"),
    ("avx512_bf16", 1.6, "bf16", "ran 1.60x as fast in bf16"),
    ("amx_bf16", 0.9, "fp32", "ran 0.90x as fast in bf16"),
])
def test_training_on_a_cpu_takes_bf16_only_where_it_measured_faster(monkeypatch, flag, gain, chosen, said):
    measured = []
    monkeypatch.setattr(dev, "native_bf16", lambda: flag)
    monkeypatch.setattr(dev, "bf16_speedup", lambda: measured.append(1) or gain)
    precision = dev.resolve_precision("auto", torch.device("cpu"), training=True)
    assert precision.name == chosen and precision.dtype == {"fp32": None, "bf16": torch.bfloat16}[chosen]
    assert said in precision.why
    assert len(measured) == (flag is not None)  # no measurement without native bf16


def test_a_training_run_says_its_precision_on_stderr(tmp_path, monkeypatch, caplog):
    from test_training import make_task

    from qkv.training import Trainer, TrainOptions

    monkeypatch.setattr(dev, "native_bf16", lambda: None)
    with caplog.at_level(logging.INFO, logger="qkv.training"):
        Trainer(make_task(), TrainOptions(out=str(tmp_path), max_steps=1, precision="auto", progress=False)).run()
    assert "precision: fp32 (this CPU has no native bf16" in caplog.text


def test_an_explicit_precision_is_never_second_guessed(monkeypatch):
    monkeypatch.setattr(dev, "native_bf16", lambda: pytest.fail("measured"))
    assert dev.resolve_precision("bf16", torch.device("cpu"), training=True).name == "bf16"
    assert dev.resolve_precision("fp32", torch.device("cpu"), training=True).name == "fp32"


def test_the_cpu_flags_and_the_measurement_are_real():
    """On this machine: a flag from /proc/cpuinfo's list or None, and a positive finite ratio (of any size: on
    busy cores one of the two timings can take a pause of the whole process)."""
    assert dev.native_bf16() in (None, *dev.NATIVE_BF16)
    gain = dev.bf16_speedup(size=64, repeats=2)
    assert 0 < gain < math.inf


@pytest.mark.parametrize("gain", [1.6, 0.9])
def test_the_processes_of_a_distributed_cpu_run_all_train_in_fp32_under_auto(monkeypatch, gain):
    """Each process would measure on its own and could choose apart: auto gives them one answer, fp32."""
    from qkv import runtime
    from qkv.distributed import Group

    monkeypatch.setattr(dev, "native_bf16", lambda: "avx512_bf16")
    monkeypatch.setattr(dev, "bf16_speedup", lambda: gain)
    monkeypatch.setattr(runtime.distributed, "setup", lambda device_type: Group(rank=1, world=2, local_rank=1))
    chosen = runtime.Runtime.resolve("cpu", "auto", training=True).precision
    assert chosen.name == "fp32" and chosen.dtype is None
    assert runtime.Runtime.resolve("cpu", "bf16", training=True).precision.name == "bf16"
    monkeypatch.setattr(runtime.distributed, "setup", lambda device_type: Group())
    assert runtime.Runtime.resolve("cpu", "auto", training=True).precision.name == ("bf16" if gain > 1.1 else "fp32")
