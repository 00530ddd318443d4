"""read_json: the value of a JSON file, or one line naming the file and what is wrong with it. write_atomically:
a file written whole, never through a symbolic link."""

import os
import stat
import subprocess
import sys

import pytest
import torch

from qkv.files import read_json, write_atomically


def test_reads_objects_and_arrays(tmp_path):
    (tmp_path / "a.json").write_text('{"x": [1, 2], "é": null}', encoding="utf-8")
    (tmp_path / "b.json").write_text("[1, 2]")
    assert read_json(tmp_path / "a.json") == {"x": [1, 2], "é": None}
    assert read_json(str(tmp_path / "b.json"), expect=list) == [1, 2]


def test_a_missing_file_is_an_error_unless_optional(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(ValueError, match="no such file") as err:
        read_json(path)
    assert str(path) in str(err.value)
    assert read_json(path, required=False) == {}
    assert read_json(path, expect=list, required=False) == []


@pytest.mark.parametrize(("content", "expect", "reason"), [
    (b"{not json", dict, r"not valid JSON \(Expecting property name .*line 1 column 2"),
    (b"\xff\xfe binary", dict, "not UTF-8 text"),
    (b"[1, 2, 3]", dict, "expected a JSON object, got a JSON array"),
    (b'{"a": 1}', list, "expected a JSON array, got a JSON object"),
    (b"null", dict, "expected a JSON object, got a JSON null"),
])
def test_bad_files_give_one_line_naming_the_file(tmp_path, content, expect, reason):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=reason) as err:
        read_json(path, expect=expect, required=False)  # a file that is there must be right, required or not
    message = str(err.value)
    assert message.startswith(f"cannot read {path}: ") and "\n" not in message


def test_a_folder_is_not_a_file(tmp_path):
    with pytest.raises(ValueError, match=f"cannot read {tmp_path}: "):
        read_json(tmp_path)


def test_a_run_file_that_became_a_link_is_replaced_not_written_through(tmp_path):
    """A link made in a run directory while the run goes on (after its start refused links): the run's next write
    replaces the link by its file, and whatever the link pointed at is untouched."""
    from qkv.progress import RunLog
    from qkv.viz import loss_curves

    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("log.csv", "log.tmp", "loss.png", "test.src.txt"):
        (run / name).symlink_to(outside)
    log = RunLog(run / "log.csv")
    log.add({"step": 1, "train_loss": 2.5, "val_loss": 2.6})
    loss_curves(log.rows, run / "loss.png")
    write_atomically(run / "test.src.txt", lambda tmp: tmp.write_text("a sentence\n", encoding="utf-8"))
    assert outside.read_text() == "keep me"
    for name in ("log.csv", "loss.png", "test.src.txt"):
        assert (run / name).is_file() and not (run / name).is_symlink(), name
    assert (run / "log.csv").read_text().startswith("step,train_loss,val_loss")
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]  # no leftovers


def test_a_failed_write_leaves_the_old_file_and_no_leftover(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, fail)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_what_is_written_gets_the_modes_the_umask_gives(tmp_path, umask_022):
    """tempfile makes private files (0600) and folders (0700): a model exported for a server running as another
    user must be readable as any other file there (0644, 0755 under umask 022)."""
    from safetensors.torch import save_file


    write_atomically(tmp_path / "model.gguf", lambda tmp: tmp.write_bytes(b"GGUF"))
    assert stat.S_IMODE((tmp_path / "model.gguf").stat().st_mode) == 0o644
    write_atomically(tmp_path / "folder", lambda folder: save_file({"w": torch.zeros(2)},
                                                                   str(folder / "model.safetensors")), folder=True)
    assert stat.S_IMODE((tmp_path / "folder").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "folder" / "model.safetensors").stat().st_mode) == 0o644


def test_temporaries_left_by_killed_processes_go_at_the_next_write(tmp_path):
    """``kill -9`` during an export leaves ``.NAME.PID.RANDOM.tmp``: the next write of NAME removes those of
    processes no longer running, and leaves a running one's (it may still be writing)."""

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = {"file": tmp_path / f".model.gguf.{dead.pid}.abc123.tmp", "folder": tmp_path / f".out.{dead.pid}.x9.tmp"}
    left["file"].write_bytes(b"half a file")
    (left["folder"]).mkdir()
    (left["folder"] / "model.safetensors").write_bytes(b"half")
    running = tmp_path / f".model.gguf.{os.getppid()}.def456.tmp"
    running.write_bytes(b"being written")
    write_atomically(tmp_path / "model.gguf", lambda tmp: tmp.write_bytes(b"GGUF"))
    write_atomically(tmp_path / "out", lambda folder: (folder / "config.json").write_text("{}"), folder=True)
    assert not left["file"].exists() and not left["folder"].exists() and running.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.gguf", "out", running.name])
