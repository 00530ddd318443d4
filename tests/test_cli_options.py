"""The command line's one validation layer for numbers: every numeric option of every command is parsed by
``qkv.cli.numbers``, which refuses nan, inf and out-of-range values in one line, before any work. Parsed
in-process (no subprocess needed to see argparse's verdict)."""

import argparse

import pytest

from qkv.cli import build_parser, parse
from qkv.cli.numbers import integer, real
from qkv.cli.train import parsers

R = ["train", "--out", "r"]
REFUSED = [
    ([*R, "--batch-tokens", "0"], "argument --batch-tokens: must be an integer >= 1, got '0'"),
    ([*R, "--batch-tokens", "-5"], "argument --batch-tokens: must be an integer >= 1, got '-5'"),
    ([*R, "--vocab-size", "-3"], "argument --vocab-size: must be an integer >= 1"),
    ([*R, "--vocab-size", "0"], "argument --vocab-size: must be an integer >= 1"),
    ([*R, "--epochs", "inf"], "argument --epochs: must be a finite number > 0, got 'inf'"),
    ([*R, "--epochs", "nan"], "argument --epochs: must be a finite number > 0, got 'nan'"),
    ([*R, "--max-minutes", "nan"], "argument --max-minutes: must be a finite number > 0"),
    ([*R, "--clip", "nan"], "argument --clip: must be a finite number >= 0, got 'nan'"),
    ([*R, "--eval-at-minutes", "nan", "-3"], "argument --eval-at-minutes: must be a finite"),
    ([*R, "--eval-at-minutes", "1", "-3"], "argument --eval-at-minutes: must be a finite number > 0"),
    ([*R, "--dropout", "1"], "argument --dropout: must be a finite number in [0, 1), got '1'"),
    ([*R, "--teacher-forcing", "1.5"], "argument --teacher-forcing: must be a finite number in [0, 1]"),
    (["train", "lm", "--out", "r", "--eval-windows", "-1"], "argument --eval-windows: must be an integer >= 0"),
    (["train", "lm", "--out", "r", "--valid-fraction", "1"], "argument --valid-fraction: must be a finite number in "
                                                             "(0, 1)"),
    (["train", "mlm", "--out", "r", "--mask-prob", "0"], "argument --mask-prob: must be a finite number in (0, 1)"),
    (["train", "classify", "--out", "r", "--seed", "-1"], "argument --seed: must be an integer in [0, 4294967295]"),
    (["demo", "--max-minutes", "nan"], "argument --max-minutes: must be a finite number > 0, got 'nan'"),
    (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["tour", "--steps", "-5"], "argument --steps: must be an integer >= 1, got '-5'"),
    (["translate", "--model", "m", "--alpha", "nan"], "argument --alpha: must be a finite number >= 0, got 'nan'"),
    (["translate", "--model", "m", "--layer", "1.5"], "argument --layer: must be an integer, got '1.5'"),
    (["evaluate", "--ref", "r", "--beam", "0"], "argument --beam: must be an integer >= 1"),
    (["generate", "--top-p", "0"], "argument --top-p: must be a finite number in (0, 1], got '0'"),
    (["generate", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["chat", "--repetition-penalty", "inf"], "argument --repetition-penalty: must be a finite number > 0"),
    (["embed", "--head", "-1"], "argument --head: must be an integer >= 0"),
    (["search", "--corpus", "c", "q", "--top-k", "0"], "argument --top-k: must be an integer >= 1"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_numbers_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("qkv ") and message in err, err


def _parsers():
    return {p.prog: p for p in parsers(build_parser())}


def test_every_numeric_option_goes_through_the_validation_layer():
    """No option of any command parses numbers with plain int or float (which accept nan, inf, -5)."""
    plain = [f"{name} {action.option_strings[0]}" for name, parser in _parsers().items()
             for action in parser._actions if action.type in (int, float)]
    assert not plain


def test_the_types_accept_what_they_should():
    assert integer(1)("3") == 3 and integer()("-2") == -2
    assert real(0, 1)("1") == 1.0 and real(above=0)("1e-3") == 1e-3
    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number in"):
        real(0, 1)("1.01")


def test_version_and_descriptions(capsys):
    from qkv import __version__

    with pytest.raises(SystemExit):
        parse(["--version"])
    assert capsys.readouterr().out.strip() == f"qkv {__version__}"
    for name, parser in _parsers().items():
        assert parser.description, f"{name} --help has no description"
    with pytest.raises(SystemExit):
        parse(["--help"])
    listing = capsys.readouterr().out
    words = " ".join(listing.split())
    assert "SUPPRESS" not in listing and "train-lm" not in listing and "translation, lm, mlm, classify" in words


def test_an_internal_error_is_one_line_and_debug_shows_its_traceback(capsys, monkeypatch):
    from qkv import cli

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli.tour, "tour", bug)
    assert cli.main(["tour"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["qkv tour: error: KeyError: 'a bug' (an internal error; --debug shows its traceback)"]
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["tour", "--debug"])


def test_stdin_is_translated_in_one_batch_like_a_file(tmp_path, monkeypatch, capsys):
    """1,000 lines piped in are read at once and handed to the batched translator together, not line by line."""
    import io

    from qkv import Transformer, TransformerConfig, cli
    from qkv.checkpoint import save_checkpoint
    from qkv.tasks import translation
    from qkv.tokenizers import CharTokenizer

    tok = CharTokenizer.train(["abc"])
    model = Transformer(TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, d_model=16,
                                          n_heads=2, n_layers=1, d_ff=32, max_seq_len=16))
    save_checkpoint(tmp_path / "m", model, tokenizers={"src": tok, "tgt": tok}, meta={"task": "translation"})
    calls, real = [], translation.translate_ids
    monkeypatch.setattr(translation, "translate_ids", lambda m, sources, **kw: calls.append(len(sources)) or
                        real(m, sources, **kw))
    monkeypatch.setattr("sys.stdin", io.StringIO("abc\n" * 1000))
    assert cli.main(["translate", "--model", str(tmp_path / "m")]) == 0
    assert calls == [1000] and len(capsys.readouterr().out.splitlines()) == 1000


no_cuda = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("argv, message", [
    pytest.param(["translate", "--model", "m", "--device", "cuda", "x"], "--device cuda: CUDA is not available",
                 marks=no_cuda),
    pytest.param(["train", "--out", "r", "--src", "s", "--tgt", "t", "--device", "cuda:1"], "CUDA is not available",
                 marks=no_cuda),
    (["generate", "--model", "m", "--prompt", "A", "--device", "tpu"], "--device 'tpu' is not a device"),
    (["embed", "x", "--device", "meta"], "--device 'meta' is not supported"),
    (["train", "lm", "--out", "r", "--text", "t", "--device", "cpu", "--precision", "fp16"],
     "--precision fp16 needs a CUDA GPU"),
])
def test_a_device_this_machine_lacks_fails_before_any_work(argv, message, here, tmp_path):
    proc = here(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory started, nothing read


def test_every_command_that_runs_a_model_takes_a_device():
    runs_a_model = {"demo", "train translation", "translate", "evaluate", "generate", "chat", "embed", "search",
                    "similarity", "classify", "train lm", "train mlm", "train classify", "train vit", "train swin",
                    "train clip", "classify-image", "zero-shot"}
    parsers = {name.removeprefix("qkv "): p for name, p in _parsers().items()}
    for name in runs_a_model:
        flags = {flag for action in parsers[name]._actions for flag in action.option_strings}
        assert {"--device", "--precision", "--compile"} <= flags, name
    for name in ("generate", "chat", "translate", "embed", "search", "similarity"):
        flags = {flag for action in parsers[name]._actions for flag in action.option_strings}
        assert {"--quantize", "--group-size"} <= flags, name
