"""Sizes typed on the command line or written in a config are checked against the machine's memory before
anything is allocated (qkv.footprint): each case ends in one line naming the figure, not in an allocator error,
a killed process or hours of building. Run in this process (``here``) where the command ends before training."""

import json
import subprocess
import sys

import pytest
from clitools import ENV, HANG, LM_TINY, TRANSLATION_TINY, last_line_error, ok, one_line_error

DATA_ARGS = ["--src", "train.de", "--tgt", "train.en", "--valid-src", "val.de", "--valid-tgt", "val.en"]
FITS = ("more than the", "of memory available; choose smaller sizes")


@pytest.mark.parametrize("option, phrase", [
    (["--d-model", "1000000000", "--n-heads", "1"], "d_model 1,000,000,000"),
    (["--max-len", "1000000000"], "max_seq_len 1,000,000,002"),
])
def test_translation_sizes_are_refused_before_allocation(cli_work, tmp_path, here, option, phrase):
    proc = here("train", *DATA_ARGS, "--out", tmp_path / "run", "--max-steps", "1", *TRANSLATION_TINY, *option,
                cwd=cli_work)
    last_line_error(proc, "the position table of the model", phrase, *FITS)


def test_a_batch_too_large_is_refused_before_training(cli_work, tmp_path, here):
    proc = here("train", "lm", "--text", "shakespeare.txt", *LM_TINY, "--batch-size", "1000000",
                "--out", tmp_path / "lm", "--max-steps", "1", cwd=cli_work)
    last_line_error(proc, "parameters and needs", "and one batch of 1,000,000 × 32 tokens", *FITS)


def test_too_many_layers_are_refused_at_once(cli_work, tmp_path, here):
    proc = here("train", "lm", "--text", "shakespeare.txt", *LM_TINY, "--n-layers", "10000000",
                "--out", tmp_path / "lm", "--max-steps", "1", cwd=cli_work)
    last_line_error(proc, "has 10,000,000 layers; qkv builds at most 4,096", "choose fewer layers")


def test_image_padding_is_counted(cli_work, tmp_path, here):
    proc = here("train", "vit", "--data", "digits", "--pad", "1000000000", "--out", tmp_path / "vit",
                "--max-steps", "1", "--no-progress", cwd=cli_work)
    last_line_error(proc, "parameters and needs", "and one batch of 128", *FITS)


def test_too_many_beams_are_refused_before_decoding(translation_trained, tmp_path, here):
    proc = here("translate", "--model", translation_trained[0], "--beam", "1000000", "Ein Hund.", cwd=tmp_path)
    one_line_error(proc, "decoding 1 sequence(s) with 1,000,000 beam(s) each to", *FITS)
    assert proc.stdout == ""


@pytest.mark.parametrize("field, value, phrase", [
    ("d_model", 10**9, "the position table of the model of"),  # sinusoidal: computed even on the meta device
    ("max_seq_len", 10**9, "the position table of the model of"),
    ("n_encoder_layers", 10**7, "has 10,000,001 layers"),  # and a decoder of 1
])
def test_a_config_too_large_is_refused_on_loading(translation_trained, copy_of, tmp_path, here, field, value,
                                                  phrase):
    run = copy_of(translation_trained[0])
    config = run / "best" / "config.json"
    data = json.loads(config.read_text())
    data["model"][field] = value
    if field == "d_model":
        data["model"]["n_heads"] = 1
    config.write_text(json.dumps(data))
    proc = here("translate", "--model", run, "Ein Hund.", cwd=tmp_path)
    one_line_error(proc, phrase)


def test_a_tiny_temperature_samples(lm_run, tmp_path, here):
    """--temperature 1e-300 ended in "probability tensor contains inf, nan"."""
    proc = ok(here("generate", "--model", lm_run, "--prompt", "To be", "--temperature", "1e-300",
                   "--max-new-tokens", "5", "--seed", str(2**32 - 1), cwd=tmp_path))
    greedy = ok(here("generate", "--model", lm_run, "--prompt", "To be", "--max-new-tokens", "5", cwd=tmp_path))
    assert proc.stdout == greedy.stdout


def test_a_huge_vocabulary_is_refused_before_the_tokenizer_is_trained(cli_work, tmp_path):
    """The tokenizers library aborted the whole process (SIGABRT, a Rust backtrace) allocating its tables: a
    subprocess, so that a failure cannot take the test run with it."""
    proc = subprocess.run([sys.executable, "-m", "qkv.cli", "train", "lm", "--text", "shakespeare.txt",
                           "--tokenizer", "bpe", "--vocab-size", "1000000000", "--out", tmp_path / "lm",
                           "--max-steps", "1", "--no-progress"], cwd=cli_work, env=ENV, capture_output=True,
                          text=True, timeout=HANG, stdin=subprocess.DEVNULL)
    last_line_error(proc, "vocab_size=1,000,000,000 is more tokens than qkv trains (at most 1,048,576)")
