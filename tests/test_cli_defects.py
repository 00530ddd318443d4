"""The command line's wrong results, unclear messages and crashes found by bad inputs (issue 24): each case is
a result that means what it says, or one line that says what to do. Most run in this process (``here``) or
call the function that decides; the ones about the process itself (a closed stdout, Ctrl-C while importing,
bytes that are not UTF-8 on stdin) start ``qkv`` as a user does."""

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clitools import ENV, HANG, command, one_line_error, qkv

from qkv.checkpoint import save_checkpoint
from qkv.cli import build_parser, parse
from qkv.cli.train import parsers
from qkv.recipes import RECIPES

# --- --debug and abbreviations (items 7 and "what a new user saw") ------------------------------------------


def _bug(args):
    raise KeyError("a bug")


@pytest.mark.parametrize("argv", [["--debug", "tour"], ["tour", "--debug"]])
def test_debug_shows_the_traceback_before_and_after_the_command(argv, monkeypatch):
    from qkv import cli

    monkeypatch.setattr(cli.tour, "tour", _bug)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(argv)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_debug_before_train_reaches_the_recipes_own_parser(recipe):
    command = RECIPES[recipe].command
    args = parse(["--debug", "train", recipe, "--out", "r"])
    assert args.command == command and args.trainer == recipe and args.debug
    args = parse(["train", recipe, "--out", "r", "--debug"])
    assert args.command == command and args.debug
    assert not parse(["train", recipe, "--out", "r"]).debug


@pytest.mark.parametrize("argv", [["train", "--out", "r"], ["--debug", "train", "--src", "a", "--out", "r"]])
def test_a_bare_train_is_the_translation_recipe(argv):
    args = parse(argv)
    assert args.trainer == "translation" and args.command == "train" and args.out == "r"


def test_train_help_lists_every_recipe(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["train", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "RECIPE" in out
    assert all(f"\n    {name}" in out for name in RECIPES), out


@pytest.mark.parametrize("command", ["demo", "tour", "generate", "chat", "embed", "similarity"])
def test_debug_works_before_and_after_every_command(command):
    assert parse(["--debug", command]).debug and parse([command, "--debug"]).debug


@pytest.mark.parametrize("argv, typo", [
    (["train", "--out", "r", "--max-minute", "2"], "--max-minute"),
    (["train", "lm", "--out", "r", "--max-step", "2"], "--max-step"),
    (["translate", "--mod", "m"], "--mod"),
    (["--deb", "tour"], "--deb"),
])
def test_a_prefix_of_an_option_is_not_taken_for_it(argv, typo, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and typo in err, err


def test_no_parser_of_qkv_accepts_abbreviations():
    every = list(parsers(build_parser()))
    assert len(every) > 20 and not [p.prog for p in every if p.allow_abbrev]


# --- a closed stdout, a reader that goes away, Ctrl-C while importing (7, 11) ------------------------------------

@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("texts")
    (folder / "hyp.txt").write_text("a cat sits on the mat\n", encoding="utf-8")
    return folder


@pytest.mark.slow
def test_writing_to_a_closed_stdout_is_an_error_not_silence(texts):
    """`qkv evaluate ... >&-`: the scores cannot be written, so the command must not end as if they were."""
    args = ["evaluate", "--hyp", "hyp.txt", "--ref", "hyp.txt"]
    proc = qkv(*args, cwd=texts, stdout=None, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 2, proc.stderr
    one_line_error(proc, "qkv evaluate: error: stdout is closed")
    discarded = subprocess.run(command(*args), cwd=texts, env=ENV, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=HANG)
    assert discarded.returncode == 0 and not discarded.stderr  # /dev/null is a place to write to


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    """An untrained character-level GPT checkpoint."""
    from qkv import GPT, GPTConfig
    from qkv.tokenizers import CharTokenizer

    tokenizer = CharTokenizer.train(["abc "])
    path = tmp_path_factory.mktemp("lm") / "lm"
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=32))
    save_checkpoint(path, model, tokenizers={"text": tokenizer}, meta={"task": "language_model"})
    return path


def test_a_streamed_generation_to_a_closed_stdout_is_an_error(tiny_lm, monkeypatch, capsys):
    """The stream writes to the stdout of the moment (not the one of import time, which may have been None)."""
    from qkv import cli

    monkeypatch.setattr("sys.stdout", None)  # what Python makes of a closed file descriptor 1
    assert cli.main(["generate", "--model", str(tiny_lm), "--prompt", "ab", "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("qkv generate: error: stdout is closed"), err


@pytest.mark.slow
def test_a_reader_that_goes_away_still_ends_with_141(texts):
    """`qkv ... | head`: the conventional status of SIGPIPE, and no message."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(command("evaluate", "--hyp", "hyp.txt", "--ref", "hyp.txt"), cwd=texts, env=ENV,
                              stdin=subprocess.DEVNULL, stdout=write, stderr=subprocess.PIPE, text=True, timeout=HANG)
    finally:
        os.close(write)
    assert proc.returncode == 141 and not proc.stderr, (proc.returncode, proc.stderr)


def _has_loaded_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see when torch is loading")
def test_ctrl_c_while_torch_is_still_importing_is_one_line_and_130(tmp_path):
    """The signal arrives as soon as torch's libraries are mapped, i.e. while `import torch` runs (it takes a
    second or more), whatever the machine's speed."""
    # Ctrl-C as a terminal delivers it, whatever this process inherited: a shell starts a background job (`pytest
    # &`, a CI script run with `&`) with SIGINT ignored, and its children would ignore the signal too
    proc = subprocess.Popen(command("similarity", "a", "b"), cwd=tmp_path, env=ENV, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not _has_loaded_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and err.splitlines() == [err.strip()] and err.strip().endswith("interrupted"), err


def test_importing_the_command_imports_no_torch():
    """What makes Ctrl-C during the start one line: the console script's module is in place within
    milliseconds, and torch is imported inside main()'s handler."""
    code = "import sys, qkv.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=HANG).stdout
    assert out.strip() == "False"


# --- input that is not UTF-8, and pipes as files (10) -----------------------------------------------------------

@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # a UTF-8 locale's stdin, and the C locale's
def test_stdin_that_is_not_utf8_names_its_line(errors, monkeypatch):
    from qkv.cli.common import read_inputs

    stdin = io.TextIOWrapper(io.BytesIO("one\ntwo\nbad \xff here\n".encode("latin-1")), encoding="utf-8",
                             errors=errors)
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(ValueError, match=r"^stdin: line 3 is not valid UTF-8 \(byte 0xff\)"):
        read_inputs([], None, "embed")


def test_stdin_in_utf8_is_read_line_by_line(monkeypatch):
    from qkv.cli.common import read_inputs

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\ufeffein Hund\r\nzwei Hunde\n".encode()),
                                                      encoding="utf-8"))
    assert read_inputs([], None, "translate", keep_blank=True) == ["ein Hund", "zwei Hunde"]


def test_an_argument_that_is_not_utf8_is_named():
    from qkv.cli.common import read_inputs

    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # how Python hands such a command-line argument over
    with pytest.raises(ValueError, match="sentence 2 of the arguments is not valid UTF-8"):
        read_inputs(["fine", bad], None, "embed")


@pytest.mark.slow
def test_embed_refuses_stdin_that_is_not_utf8_before_loading_a_model(tmp_path):
    proc = subprocess.run(command("embed"), cwd=tmp_path, env={**ENV, "LC_ALL": "C"}, input=b"one\n\xfftwo\n",
                          capture_output=True, timeout=HANG)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.splitlines() == ["qkv embed: error: stdin: line 2 is not valid UTF-8 (byte "
                                                         "0xff); convert it to UTF-8"], err


def test_a_pipe_given_as_a_training_file_keeps_its_name():
    """`qkv train --src <(zcat train.de.gz)`: the option names /dev/fd/N, a pipe, which resolving would turn into
    /proc/PID/fd/pipe:[N], a name nothing can open ("no such file")."""
    from qkv.data import read_lines
    from qkv.recipes.settings import merged_settings

    read, write = os.pipe()
    try:
        os.write(write, b"ein Hund\nzwei Hunde\n")
        os.close(write)
        args = argparse.Namespace(src=f"/dev/fd/{read}", out="r", resume=False)
        s = merged_settings(args, {"src": None}, command="train", paths=("src",))
        assert s["src"] == f"/dev/fd/{read}"
        assert read_lines(s["src"]) == ["ein Hund", "zwei Hunde"]
    finally:
        os.close(read)


def test_a_regular_training_file_is_stored_absolute(tmp_path, monkeypatch):
    from qkv.recipes.settings import merged_settings

    (tmp_path / "train.de").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(src="train.de", out="r", resume=False)
    assert merged_settings(args, {"src": None}, command="train", paths=("src",))["src"] == str(
        (tmp_path / "train.de").resolve())


# --- qkv similarity with one sentence (10) --------------------------------------------------------------------

@pytest.mark.parametrize("sentences", [["only one"], ["one", "two", "three"], []])
def test_similarity_says_it_compares_two_sentences(sentences, here, tmp_path):
    proc = here("similarity", *sentences, cwd=tmp_path)
    one_line_error(proc, "qkv similarity compares two sentences", f"got {len(sentences)}")
    assert proc.returncode == 2


# --- zero-shot templates and labels (7, 10) ---------------------------------------------------------------------

@pytest.mark.parametrize("template, phrase", [
    ("a {} next to a {}", "exactly one {} where the label goes (it has {}, {})"),
    ("a photo of a {0", "is not a template"),
    ("a photo of a {label}", "(it has {label})"),
    ("a photo of a {0}", "(it has {0})"),
    ("a photo}", "is not a template"),
    ("a photo", "has no {} where the label goes"),
])
def test_a_broken_template_is_one_line_before_the_model_loads(template, phrase, here, tmp_path):
    proc = here("zero-shot", "--model", tmp_path / "nowhere", "--data", "digits", "--template", template,
                cwd=tmp_path)
    one_line_error(proc, "--template", phrase)


def test_a_template_with_literal_braces_is_a_template():
    from qkv.tasks.captions import check_template

    assert check_template("a {{set}} of {}") == "a {{set}} of {}"
    assert check_template("a {{set}} of {}").format("x") == "a {set} of x"


@pytest.fixture(scope="module")
def clip_digits(tmp_path_factory) -> Path:
    """A tiny untrained CLIP checkpoint for the digits (8×8 grey), saved as qkv train clip saves one."""
    from qkv.config import CLIPConfig
    from qkv.models import CLIP
    from qkv.tasks.captions import HELD_OUT_TEMPLATES, CaptionSet
    from qkv.tokenizers import EOS_ID, BPETokenizer

    torch.manual_seed(0)
    captions = CaptionSet.from_names([str(d) for d in range(10)])
    tokenizer = BPETokenizer.train(captions.training_text(), vocab_size=200, min_frequency=1)
    vision = dict(image_size=8, channels=1, patch_size=2, d_model=16, n_heads=2, n_layers=1, n_classes=None)
    text = dict(d_model=16, n_heads=2, n_layers=1, vocab_size=tokenizer.vocab_size, eos_id=EOS_ID, max_seq_len=32)
    model = CLIP(CLIPConfig.from_preset("fashion", vision=vision, text=text, projection_dim=8))
    path = tmp_path_factory.mktemp("clip") / "clip"
    save_checkpoint(path, model, tokenizers={"text": tokenizer},
                    meta={"task": "contrastive", "labels": [str(d) for d in range(10)],
                          "class_names": list(captions.names), "templates": list(HELD_OUT_TEMPLATES[:2]),
                          "mean": [0.3], "std": [0.4], "image_shape": [1, 8, 8]})
    return path


def test_zero_shot_refuses_an_accuracy_against_labels_that_are_not_the_datasets(clip_digits, here, tmp_path):
    """`--labels nine,eight` on digits (classes 0..9): scoring them against ten classes means nothing."""
    proc = here("zero-shot", "--model", clip_digits, "--data", "digits", "--labels", "nine,eight", cwd=tmp_path)
    one_line_error(proc, "--labels", "each name one of its 10 classes", "'nine' is none of them")
    assert not proc.stdout


def test_zero_shot_scores_only_the_classes_the_labels_name(clip_digits, here, tmp_path):
    from qkv.images import load_dataset

    labels = load_dataset("digits", "test").labels
    proc = here("zero-shot", "--model", clip_digits, "--data", "digits", "--labels", "9,8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    n = int(((labels == 8) | (labels == 9)).sum())
    assert f"on {n} digits test images of the 2 classes --labels names" in proc.stdout, proc.stdout


def test_zero_shot_labels_that_rename_every_class_in_order_are_scored_on_all(clip_digits, here, tmp_path):
    names = "zero,one,two,three,four,five,six,seven,eight,nine"
    proc = here("zero-shot", "--model", clip_digits, "--data", "digits", "--labels", names, cwd=tmp_path)
    assert proc.returncode == 0 and "on 359 digits test images, labels" in proc.stdout, proc.stderr
    assert "read as their new names, in order (0=zero, 1=one" in proc.stderr


def test_zero_shot_checks_the_models_own_templates(clip_digits, copy_of, here, tmp_path):
    run = copy_of(clip_digits)
    config = json.loads((run / "config.json").read_text())
    config["templates"] = ["a photo of {label}"]
    (run / "config.json").write_text(json.dumps(config))
    proc = here("zero-shot", "--model", run, "--data", "digits", cwd=tmp_path)
    one_line_error(proc, "the config's template 'a photo of {label}'", "exactly one {}")


# --- image classifiers: the test set scored, the labels printed, the image named (7, 10) --------------------

def test_train_vit_refuses_a_test_folder_beside_a_dataset_with_its_own(here, tmp_path):
    (tmp_path / "mine" / "a").mkdir(parents=True)
    proc = here("train", "vit", "--data", "digits", "--test-data", tmp_path / "mine", "--out", tmp_path / "run",
                "--max-steps", "1", "--no-progress", cwd=tmp_path)
    one_line_error(proc, "--test-data", "--data digits has its own test split")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def vit_digits(tmp_path_factory) -> Path:
    """A tiny untrained ViT classifier checkpoint for the digits."""
    from qkv.config import ViTConfig
    from qkv.models import ViTClassifier

    torch.manual_seed(0)
    cfg = ViTConfig.from_preset("fashion", image_size=8, patch_size=2, channels=1, d_model=16, n_heads=2,
                                n_layers=1, d_ff=32, n_classes=10)
    path = tmp_path_factory.mktemp("vit") / "vit"
    save_checkpoint(path, ViTClassifier(cfg), tokenizers={},
                    meta={"task": "classify-image", "labels": [str(d) for d in range(10)], "mean": [0.3],
                          "std": [0.4], "image_shape": [1, 8, 8]})
    return path


def test_the_attention_picture_names_the_image_by_its_dataset_index(vit_digits, here, tmp_path):
    proc = here("classify-image", "--model", vit_digits, "--data", "digits", "--index", "9", "--attention",
                tmp_path / "att.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\tdigits[9]\n")
    assert f"attention of digits[9]: {tmp_path / 'att.png'}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("labels", [["0", "1", "2"], "0123456789"])
def test_labels_that_do_not_name_each_class_are_not_printed(labels, vit_digits, copy_of, here, tmp_path):
    """Fewer labels than classes, or a string (a letter a class): one line naming the checkpoint, no output
    (checked where the checkpoint is loaded, qkv.checkpoint)."""
    run = copy_of(vit_digits)
    config = json.loads((run / "config.json").read_text())
    config["labels"] = labels
    (run / "config.json").write_text(json.dumps(config))
    proc = here("classify-image", "--model", run, "--data", "digits", "--index", *range(10), cwd=tmp_path)
    one_line_error(proc, "labels")
    assert proc.returncode == 2 and not proc.stdout


# --- qkv train mlm with too little validation text (7) -------------------------------------------------------

def test_masked_lm_validation_that_hides_nothing_is_refused_not_scored_zero():
    from qkv.config import BERTConfig
    from qkv.models import BERTForMaskedLM
    from qkv.tasks.masked_lm import MaskedLMTask, encode_for_mlm
    from qkv.tokenizers import WordPieceTokenizer

    text = ["the quick brown fox jumps over the lazy dog"] * 20
    tokenizer = WordPieceTokenizer.train(text, vocab_size=120)
    model = BERTForMaskedLM(BERTConfig(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, d_model=16,
                                       n_heads=2, n_layers=1, d_ff=32, max_seq_len=32))
    train = encode_for_mlm(tokenizer, text, 32)
    valid = encode_for_mlm(tokenizer, ["dog"], 32)  # one token: at 15%, nothing is hidden with this seed
    with pytest.raises(ValueError, match=r"the validation text is 1 token\(s\), too little to hide any at 15%"):
        MaskedLMTask(model, tokenizer, train, valid, batch_size=4)


def test_train_lm_refuses_a_context_of_one_before_training(here, tmp_path):
    """It used to train, save best/, then exit 2 in the closing sample ("position 1 is beyond max_seq_len=1")."""
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question.\n" * 20)
    proc = here("train", "lm", "--text", tmp_path / "t.txt", "--out", tmp_path / "run", "--context", "1",
                "--max-steps", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "run" / "best").exists(), proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--context 1 leaves no room to continue a text: a language "
                                                         "model reads at least 2 tokens at once; give --context 2 or "
                                                         "more"), proc.stderr


def test_train_mlm_on_one_line_says_how_much_text_it_needs(here, tmp_path):
    (tmp_path / "one.txt").write_text("The quick brown fox jumps over the lazy dog and runs into the forest.\n")
    proc = here("train", "mlm", "--text", tmp_path / "one.txt", "--out", tmp_path / "run", "--vocab-size", "100",
                "--max-steps", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2 and "val_loss" not in proc.stdout + proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("qkv train mlm: error: ") and "tokens of validation" in last, last
