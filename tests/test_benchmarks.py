"""The training-step and fine-tuning benchmarks' contenders still run against today's API: one step of each,
smallest sizes. (The benchmarks time nothing here; they are programs for a quiet machine.)"""

import importlib.util
from pathlib import Path

import pytest
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
                 bench.qkv_step(stream, compiled=False, bias=False),
                 bench.translation_step("fp32", dropout=0.0, batch=2, length=4, vocab=64)):
        step()


def test_every_finetune_contender_takes_a_step():
    """qkv's LoRA step and peft's, tiny LLaMAs, on the one padded batch both read (no GGUF file, no data)."""
    from types import SimpleNamespace

    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from qkv import GPT, GPTConfig
    from qkv.tasks.finetune import Example

    bench = load("bench_finetune")
    torch.manual_seed(0)
    examples = [Example(torch.randint(0, 64, (n,)).tolist(), [False] * 3 + [True] * (n - 3)) for n in (7, 11)]
    qkv_model = GPT(GPTConfig.from_preset("llama", vocab_size=64, d_model=32, n_heads=2, n_layers=1, d_ff=64,
                                          max_seq_len=16))
    task = bench.qkv_task(bench.qkv_lora(qkv_model, 2, 4.0), SimpleNamespace(pad_id=0), examples, examples, 2, 16)
    batch = task.batches(0)[0]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                                num_hidden_layers=1, num_attention_heads=2))
    peft_model = bench.peft_lora(hf, 2, 4.0)
    for step in (bench.qkv_step(task, 1e-3), bench.peft_step(peft_model, 1e-3)):
        assert torch.isfinite(torch.tensor(step(batch)))
    assert bench.peft_evaluate(peft_model.eval(), task.valid_batches()) > 0
