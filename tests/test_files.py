"""read_json: the value of a JSON file, or one line naming the file and what is wrong with it. write_atomically:
a file written whole, never through a symbolic link."""

import pytest

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
