"""qkv on a CUDA GPU: the same numbers as on the CPU, cached = uncached decoding there, bf16 training that
learns, and checkpoints that move between the two. Skipped, with the reason, on a machine without CUDA; run with
``python -m pytest -m gpu``.

Tolerances: fp32 with TF32 switched off agrees with the CPU to 1e-4; qkv switches TF32 on for GPUs
(``qkv.device.prepare``), whose 10-bit mantissa moves these small models' logits by up to about 1e-2.
"""

import pytest
import torch

from qkv import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig
from qkv.checkpoint import load_checkpoint, save_checkpoint
from qkv.tasks.translation import ParallelData, TranslationTask, translate
from qkv.tokenizers import CharTokenizer
from qkv.training import Trainer, TrainOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]

WORDS = ["the", "red", "robot", "picked", "up", "a", "blue", "ball", "and", "the", "cat", "sat", "on", "it"]


@pytest.fixture
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _families():
    torch.manual_seed(0)
    src, tgt = torch.randint(1, 50, (3, 9)), torch.randint(1, 50, (3, 7))
    src[1, 6:] = 0
    return [
        ("gpt2", GPT(GPTConfig(vocab_size=100, d_model=64, n_heads=4, n_layers=2, max_seq_len=32)),
         (torch.randint(0, 100, (3, 16)),)),
        ("llama", GPT(GPTConfig.from_preset("llama", vocab_size=100, d_model=64, n_heads=4, n_kv_heads=2,
                                            n_layers=2, max_seq_len=32)), (torch.randint(0, 100, (3, 16)),)),
        ("transformer", Transformer(TransformerConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=64, n_heads=4,
                                                      n_layers=2, d_ff=128, max_seq_len=32)), (src, tgt)),
        ("bert", BERT(BERTConfig(vocab_size=60, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=32)),
         (torch.randint(1, 60, (3, 11)),)),
    ]


@pytest.mark.parametrize("name, model, inputs", [pytest.param(*f, id=f[0]) for f in _families()])
def test_every_family_gives_the_cpus_numbers(name, model, inputs, no_tf32):
    model.eval()
    with torch.no_grad():
        cpu = model(*inputs)
        cuda = model.cuda()(*(x.cuda() for x in inputs)).cpu()
    torch.testing.assert_close(cuda, cpu, atol=1e-4, rtol=1e-4)


def _pairs(n=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        words = [WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(2, 6, (1,), generator=g)),),
                                                 generator=g)]
        pairs.append((" ".join(words), " ".join(reversed(words))))
    return pairs


def _task(device, precision="fp32", out=None, steps=0):
    pairs = _pairs()
    tok = CharTokenizer.train([p[0] for p in pairs])
    toks = {"src": tok, "tgt": tok}
    data = ParallelData.encode(pairs, toks, max_len=60, name="train")
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, d_model=64,
                                          n_heads=4, n_layers=2, d_ff=128, dropout=0.0, share_embeddings=True,
                                          max_seq_len=64))
    task = TranslationTask(model, toks, data, data, batch_tokens=1200, bleu_samples=0)
    if steps:
        Trainer(task, TrainOptions(out=str(out), max_steps=steps, lr=3e-3, warmup=10, eval_every=steps,
                                   progress=False, device=device, precision=precision)).run()
    return task


def test_bf16_training_on_the_gpu_lowers_the_loss(tmp_path):
    task = _task("cuda")
    task.model.cuda()
    with torch.no_grad():
        before = task.evaluate(task.model)["val_loss"]
    result = Trainer(task, TrainOptions(out=str(tmp_path), max_steps=60, lr=3e-3, warmup=10, eval_every=60,
                                        progress=False, device="cuda", precision="bf16")).run()
    assert result.last_eval["val_loss"] < 0.7 * before


def test_cached_and_uncached_decoding_agree_on_the_gpu(tmp_path):
    task = _task("cuda", out=tmp_path, steps=80)
    sources = [p[0] for p in _pairs(20, seed=1)]
    for beam in (1, 3):
        cached = translate(task.model, task.tokenizers, sources, beam_size=beam)
        uncached = translate(task.model, task.tokenizers, sources, beam_size=beam, use_cache=False)
        assert cached == uncached


def test_a_gpu_checkpoint_translates_the_same_on_the_cpu(tmp_path, no_tf32):
    task = _task("cuda", out=tmp_path / "run", steps=80)
    sources = [p[0] for p in _pairs(20, seed=2)]
    on_gpu = translate(task.model, task.tokenizers, sources)
    save_checkpoint(tmp_path / "ckpt", task.model, tokenizers=task.tokenizers)
    on_cpu = load_checkpoint(tmp_path / "ckpt")  # built and loaded on the CPU
    assert translate(on_cpu.model, on_cpu.tokenizers, sources) == on_gpu


def test_a_cpu_run_resumes_on_the_gpu(tmp_path):
    _task("cpu", out=tmp_path, steps=20)
    task = _task("cpu")
    result = Trainer(task, TrainOptions(out=str(tmp_path), max_steps=30, lr=3e-3, warmup=10, eval_every=10,
                                        progress=False, device="cuda", resume=True)).run()
    assert result.step == 30 and next(task.model.parameters()).is_cuda


def test_compiled_decoding_on_the_gpu_equals_eager():
    """The preallocated KV cache compiles on CUDA too (dynamic shapes: no recompilation per step)."""
    from decoding_reference import continue_prompts

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("llama", vocab_size=100, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2,
                                      max_seq_len=64)).cuda().eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    eager = continue_prompts(model, prompts, 24)
    torch._dynamo.reset()
    model.compile(dynamic=True)
    assert continue_prompts(model, prompts, 24) == eager
