"""The library's own words said plainly at the CLI's error boundary: an OSError as its path (the name the user
gave, never a save's scratch name) and what to do, without ``[Errno N]``; Python's integer-digit limit as a
number too long; a distributed run's lost peer as what happened, not an internal error. Each is one line."""

import json
import os

import pytest
import torch

from qkv.cli import _one_line


def said(err: BaseException, capsys) -> tuple[int, str]:
    status = _one_line("cmd", err)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv cmd: error: ") and "[Errno" not in lines[0], lines
    return status, lines[0]


def test_a_missing_path_and_a_file_taken_for_a_folder_name_the_path_and_say_what_to_do(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text("")
    for path, words in ((tmp_path / "gone" / "x", "no such file or directory; check the path"),
                        (tmp_path / "data.jsonl" / "x", "not a directory; a part of the path is a file, not a folder; "
                                                        "check the path")):
        with pytest.raises(OSError) as caught:
            path.read_text()
        assert said(caught.value, capsys) == (2, f"qkv cmd: error: '{path}': {words}")


def test_a_folder_where_a_file_is_written_names_the_file_not_the_scratch_file(tmp_path, capsys):
    (tmp_path / "map.png").mkdir()
    scratch = tmp_path / ".map.png.4242.k3j9x_2q.tmp"  # as qkv.files.scratch_beside names it
    scratch.write_bytes(b"x")
    with pytest.raises(OSError) as caught:
        os.replace(scratch, tmp_path / "map.png")
    assert ".tmp" in str(caught.value)  # what Python says
    line = said(caught.value, capsys)[1]
    assert line == f"qkv cmd: error: '{tmp_path / 'map.png'}': is a directory; give a file, not a folder"
    nested = FileNotFoundError(2, "No such file or directory", str(tmp_path / ".best.4242.x1y2.tmp" / "config.json"))
    assert f"'{tmp_path / 'best' / 'config.json'}': no such file" in said(nested, capsys)[1]


def test_a_number_past_pythons_digit_limit_is_said_as_a_number_too_long(capsys):
    with pytest.raises(ValueError) as caught:
        json.loads('{"lora_alpha": ' + "1" * 5000 + "}")
    status, line = said(ValueError(f"adapter_config.json: {caught.value}"), capsys)
    assert status == 2 and "set_int_max_str_digits" not in line
    assert "adapter_config.json: a number of 5,000 digits is longer than the 4,300 digits qkv reads" in line


# What the surviving process of a two-process gloo run raised when the other was killed (torch 2.13).
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:62113. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
        "before reporting an error. GLHF! \N{UMBRELLA ON GROUND}")


@pytest.mark.parametrize("err", [RuntimeError(GLOO), torch.distributed.DistBackendError("NCCL error: remote process "
                                                                                        "exited")])
def test_a_lost_process_of_a_distributed_run_is_said_with_what_to_do(err, capsys):
    status, line = said(err, capsys)
    assert status == 2 and "internal error" not in line and "GLHF" not in line
    assert "another process of this distributed run stopped" in line and "with --resume once it has saved" in line
    assert said(RuntimeError("a bug"), capsys)[0] == 1  # any other RuntimeError is still an internal error
