"""`qkv explore` on the command line: an exported page of each kind of text model, a server that says where it
listens, and each mistake in one line."""

import json
import os
import re

import pytest
from clitools import ok, one_line_error, qkv

from qkv.interop.sentence import MINILM_INSTALL, minilm_path


def _data(path):
    html = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script id="qkv-data" type="application/json">(.*?)</script>', html, re.S)[1])


def test_export_writes_one_page_per_model(lm_dir, translator_dir, tmp_path):
    proc = ok(qkv("explore", "--model", lm_dir, "--export", "lm.html", "--text", "the cat", "--new-tokens", "4",
                  cwd=tmp_path))
    assert "wrote lm.html" in proc.stdout
    data = _data(tmp_path / "lm.html")
    assert data["kind"] == "lm" and len(data["steps"]["tokens"]) == 4 and data["input"] == "the cat"
    ok(qkv("explore", "--model", translator_dir, "--export", "t.html", "--text", "猫坐", cwd=tmp_path))
    assert [v["id"] for v in _data(tmp_path / "t.html")["views"]] == ["encoder", "decoder", "cross"]
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically


@pytest.mark.skipif(minilm_path() is None, reason=f"all-MiniLM-L6-v2 is not installed: {MINILM_INSTALL}")
def test_export_minilm(here, tmp_path):
    ok(here("explore", "--pretrained", "minilm", "--export", "m.html", "--text", "A cat sleeps.", cwd=tmp_path))
    view = _data(tmp_path / "m.html")["views"][0]
    assert view["queries"] == ["[CLS]", "a", "cat", "sleeps", ".", "[SEP]"] and len(view["attention"]) == 6


def test_mistakes_end_in_one_line(here, lm_dir, tmp_path):
    one_line_error(here("explore", cwd=tmp_path), "give one model: --model DIR")
    one_line_error(here("explore", "--model", lm_dir, "--export", "x.html", cwd=tmp_path),
                   "--export needs --text (or --image for an image model)")
    one_line_error(here("explore", "--model", lm_dir, "--text", "hi", cwd=tmp_path),
                   "--text and --image go with --export FILE.html")
    one_line_error(here("explore", "--model", lm_dir, "--export", "x.txt", "--text", "hi", cwd=tmp_path),
                   "--export writes an HTML page: name it FILE.html, not x.txt")
    one_line_error(here("explore", "--model", lm_dir, "--export", "no/x.html", "--text", "hi", cwd=tmp_path),
                   "the folder no does not exist")
    one_line_error(here("explore", "--model", lm_dir, "--export", "x.html", "--text", "x" * 60, cwd=tmp_path),
                   "the prompt is 60 tokens long; the explorer shows at most 48: shorten it")
    one_line_error(here("explore", "--model", tmp_path / "none", cwd=tmp_path), "none")
    one_line_error(here("explore", "--model", lm_dir, "--port", "70000", cwd=tmp_path),
                   "argument --port: must be an integer")
    one_line_error(here("explore", "--model", lm_dir, "--new-tokens", "60", cwd=tmp_path),
                   "--new-tokens 60 leaves no room for a prompt", "give at most 56")
    assert not (tmp_path / "x.html").exists()
    one_line_error(here("explore", "--model", lm_dir, "--export", "y.html", "--text", "to \udcffbe", cwd=tmp_path),
                   "--text is not valid UTF-8 (byte 0xff)")
    (tmp_path / "kept.html").write_text("a page of mine")
    one_line_error(here("explore", "--model", lm_dir, "--export", "kept.html", "--text", "hi", cwd=tmp_path),
                   "kept.html exists; give --export a new file (an export never overwrites)")
    assert (tmp_path / "kept.html").read_text() == "a page of mine"


def test_export_an_image_classifier_and_image_mistakes(here, vit_dir, lm_dir, png, tmp_path):
    ok(here("explore", "--model", vit_dir, "--export", "v.html", "--image", png, cwd=tmp_path))
    data = _data(tmp_path / "v.html")
    assert data["kind"] == "image" and data["image"]["grid"] == [2, 2] and len(data["views"][0]["queries"]) == 5
    assert data["steps"]["top"][0][0]["token"] in ("cat", "dog", "猫")
    one_line_error(here("explore", "--model", vit_dir, "--export", "w.html", "--text", "hi", cwd=tmp_path),
                   "is an image model: export with --image FILE.png, not --text")
    one_line_error(here("explore", "--model", lm_dir, "--export", "w.html", "--image", png, cwd=tmp_path),
                   "reads text: export with --text")
    one_line_error(here("explore", "--model", vit_dir, "--export", "w.html", "--image", "none.png", cwd=tmp_path),
                   "--image none.png: no such file")
    (tmp_path / "fake.png").write_text("not an image")
    one_line_error(here("explore", "--model", vit_dir, "--export", "w.html", "--image", "fake.png", cwd=tmp_path),
                   "cannot read the image")


def test_export_a_clip_with_its_zero_shot_classes(here, clip_dir, png, tmp_path):
    ok(here("explore", "--model", clip_dir, "--export", "c.html", "--image", png, cwd=tmp_path))
    data = _data(tmp_path / "c.html")
    assert data["kind"] == "image" and len(data["views"][0]["attention"]) == 2  # the image tower's two layers
    top = data["steps"]["top"][0]
    assert sorted(c["token"] for c in top) == ["cat", "dog"] and abs(sum(c["p"] for c in top) - 1) < 1e-3


def test_export_to_a_directory_says_so_and_names_no_scratch_file(here, lm_dir, tmp_path):
    """A directory where the page's file should be: one line naming the user's path, never `[Errno 21]` with the
    scratch file's name; what was there stays as it was."""
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "mine.html").write_text("a page of mine")
    for given in ("pages", "pages/", "."):
        line = one_line_error(here("explore", "--model", lm_dir, "--export", given, "--text", "hi", cwd=tmp_path),
                              "is a directory; name a new file in it, e.g. --export")
        assert "Errno" not in line and ".tmp" not in line, line
    assert [p.name for p in pages.iterdir()] == ["mine.html"] and (pages / "mine.html").read_text() == "a page of mine"


@pytest.mark.parametrize("change, phrase", [
    (lambda path: path.mkdir(), "is a directory; name a new file in it"),  # a directory made there meanwhile
    (lambda path: path.parent.rmdir(), "cannot write sub/x.html: No such file or directory"),  # the folder removed
], ids=["a-directory-made-there", "the-folder-removed"])
def test_export_whose_folder_changed_while_the_model_ran_names_the_users_path(here, lm_dir, tmp_path, monkeypatch,
                                                                              change, phrase):
    from qkv.cli import explore

    (tmp_path / "sub").mkdir()
    load = explore._explorer

    def loaded_then_changed(args, device):
        explorer = load(args, device)
        change(tmp_path / "sub" / "x.html")
        return explorer

    monkeypatch.setattr(explore, "_explorer", loaded_then_changed)
    line = one_line_error(here("explore", "--model", lm_dir, "--export", "sub/x.html", "--text", "hi", cwd=tmp_path),
                          phrase)
    assert "Errno" not in line and ".tmp" not in line, line
    assert not list(tmp_path.rglob(".*.tmp"))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="the superuser may write in any folder")
def test_export_into_a_folder_without_permission_names_it(here, lm_dir, tmp_path):
    shut = tmp_path / "shut"
    shut.mkdir(mode=0o500)
    try:
        one_line_error(here("explore", "--model", lm_dir, "--export", "shut/x.html", "--text", "hi", cwd=tmp_path),
                       "cannot write shut/x.html: no permission to write in shut")
    finally:
        shut.chmod(0o700)
