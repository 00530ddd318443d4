"""The files a command writes beside its answer (``qkv embed --output``, ``--attention`` maps, translations,
``--show-routing``) never replace an
existing file without ``--force``: refused in one line before any model loads, the file as it was; with ``--force``
replaced whole, and a link in its place is replaced, never written through."""

import pytest
from clitools import ok, one_line_error

from qkv.interop.sentence import MINILM_INSTALL, minilm_path

needs_minilm = pytest.mark.skipif(minilm_path() is None, reason=f"all-MiniLM-L6-v2 is not installed: {MINILM_INSTALL}")


@pytest.mark.parametrize("args", [
    ["embed", "A dog runs.", "--output", "out.jsonl"],
    ["embed", "A dog runs.", "--attention", "out.jsonl"],
    ["similarity", "A dog.", "A cat.", "--attention", "out.jsonl"],
    ["classify-image", "x.png", "--attention", "out.jsonl"],
    ["zero-shot", "x.png", "--labels", "a,b", "--attention", "out.jsonl"],
    ["translate", "A dog.", "--output", "out.jsonl"],
    ["translate", "A dog.", "--attention", "out.jsonl"],
    ["evaluate", "--ref", "ref.txt", "--src", "ref.txt", "--output", "out.jsonl"],
    ["generate", "--prompt", "A dog", "--show-routing", "out.jsonl"],
])
def test_an_existing_file_is_refused_before_the_model_loads(args, here, tmp_path):
    """--model names nothing: the refusal comes first."""
    (tmp_path / "out.jsonl").write_text("the user's own")
    option = args[args.index("out.jsonl") - 1]
    one_line_error(here(*args, "--model", "no-such-model", cwd=tmp_path),
                   f"{option} 'out.jsonl' exists; pass --force to replace it, or give another name")
    assert (tmp_path / "out.jsonl").read_text() == "the user's own"


def test_a_folder_is_never_replaced(here, tmp_path):
    (tmp_path / "out.npy").mkdir()
    one_line_error(here("embed", "A dog.", "--output", "out.npy", "--force", cwd=tmp_path),
                   "--output 'out.npy' is a folder; give a file name")


@needs_minilm
def test_force_replaces_the_file_and_a_link_not_what_it_points_to(here, tmp_path):
    import numpy as np

    (tmp_path / "out.jsonl").write_text("the user's own")
    ok(here("embed", "A dog runs.", "--output", "out.jsonl", "--force", cwd=tmp_path))
    assert '"text": "A dog runs."' in (tmp_path / "out.jsonl").read_text()
    (tmp_path / "victim").write_text("elsewhere")
    (tmp_path / "out.npy").symlink_to(tmp_path / "victim")
    one_line_error(here("embed", "A dog runs.", "--output", "out.npy", cwd=tmp_path), "exists")
    ok(here("embed", "A dog runs.", "A cat sleeps.", "--output", "out.npy", "--force", cwd=tmp_path))
    assert not (tmp_path / "out.npy").is_symlink() and np.load(tmp_path / "out.npy").shape == (2, 384)
    assert (tmp_path / "victim").read_text() == "elsewhere"
