"""Fixtures for the whole suite: a fixed random state for every test, and the small trained runs the command-line
tests share (trained once per session, in subprocesses, as a user would)."""

import io
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from clitools import DATA, LM_TINY, TRANSLATION_TINY, gz_lines, qkv
from shared_data import missing_corpora


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state, so failures reproduce."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of the shared corpora; a test that asks for it is skipped, saying what to fetch and where, when
    they are absent (a clone outside this setup)."""
    reason = missing_corpora(DATA)
    if reason:
        pytest.skip(reason)
    return DATA


@pytest.fixture(scope="session")
def cli_work(tmp_path_factory, shared_data) -> Path:
    """A folder with 400 training, 50 validation and 10 test pairs of Multi30k de-en, 300 Tatoeba en-zh pairs
    and 20,000 characters of tinyshakespeare."""
    multi30k, tatoeba = shared_data / "multi30k", shared_data / "tatoeba-en-zh" / "cmn.txt"
    shakespeare = shared_data / "tinyshakespeare" / "input.txt"
    work = tmp_path_factory.mktemp("cli")
    for split, n, name in [("train", 400, "train"), ("val", 50, "val"), ("test_2016_flickr", 10, "test")]:
        for lang in ("de", "en"):
            (work / f"{name}.{lang}").write_text("\n".join(gz_lines(multi30k / f"{split}.{lang}.gz", n)) + "\n",
                                                 encoding="utf-8")
    lines = tatoeba.read_text(encoding="utf-8").splitlines()
    (work / "zh.tsv").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    (work / "shakespeare.txt").write_text(shakespeare.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return work


@pytest.fixture(scope="session")
def translation_trained(cli_work):
    """A tiny de-en Transformer trained 6 steps with ``qkv train``, and how that command ended."""
    proc = qkv("train", "--src", "train.de", "--tgt", "train.en", "--valid-src", "val.de", "--valid-tgt", "val.en",
               "--out", "run", "--max-steps", "6", *TRANSLATION_TINY, cwd=cli_work)
    assert proc.returncode == 0, proc.stderr
    return cli_work / "run", proc


@pytest.fixture(scope="session")
def lm_run(cli_work) -> Path:
    """A tiny character-level GPT trained 6 steps with ``qkv train lm``."""
    proc = qkv("train", "lm", "--text", "shakespeare.txt", "--out", "lm", "--max-steps", "6", *LM_TINY, cwd=cli_work)
    assert proc.returncode == 0, proc.stderr
    return cli_work / "lm"


@pytest.fixture
def copy_of(tmp_path):
    """``copy_of(run)``: a copy of a shared run that a test may damage."""
    return lambda run: Path(shutil.copytree(run, tmp_path / run.name))


@pytest.fixture
def here(capsys, monkeypatch):
    """``here(*args, cwd=DIR, input=None)``: the ``qkv`` command run in this process, as a CompletedProcess. For
    the checks that end before any real work, where starting an interpreter and importing torch would be most of
    the time (the subprocess tests cover the command as a user starts it). Without ``input``, stdin is a
    terminal."""
    import logging

    root = logging.getLogger()  # main() configures logging; leave it as it was for the tests that follow
    monkeypatch.setattr(root, "handlers", root.handlers)
    monkeypatch.setattr(root, "level", root.level)

    def run(*args, cwd: Path, input: str | None = None) -> subprocess.CompletedProcess:
        from qkv.cli import main

        monkeypatch.chdir(cwd)
        stdin = io.StringIO(input or "")
        stdin.isatty = lambda: input is None
        monkeypatch.setattr("sys.stdin", stdin)
        capsys.readouterr()
        root.handlers = []  # pytest's own log capture among them: main() logs to this stderr, as a user sees it
        try:
            status = main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's own errors
            status = exit_.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["qkv", *map(str, args)], status, out, err)

    return run


def pytest_collection_modifyitems(items):
    """The files with slow tests first, each file's tests in their own order: the workers start on the long
    files and fill the end with short ones, instead of one worker finishing a long file alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_configure(config):
    """Under pytest-xdist (``-n 2``) each worker computes on one thread: two workers on two cores, not four
    threads fighting over them."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
