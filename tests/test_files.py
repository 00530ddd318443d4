"""read_json: the value of a JSON file, or one line naming the file and what is wrong with it."""

import pytest

from qkv.files import read_json


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
