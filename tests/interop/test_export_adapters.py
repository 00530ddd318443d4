"""``qkv export`` of a LoRA run: the adapters go out only as loading would take them in (finite weights of their
checksum, no link followed out of the run), peft is told a base it can resolve, and a write that fails (a full
disk) is one line naming the file, with nothing left half-written."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from clitools import last_line_error
from finetune_model import chat_folder
from safetensors.torch import load_file, save_file

from qkv.adapters import CONFIG, WEIGHTS, read_peft_adapter
from qkv.checkpoint import CHECKSUM, save_checkpoint
from qkv.files import file_sha256
from qkv.interop.pretrained import load_pretrained
from qkv.lora import LoRAConfig, add_lora, lora_layers
from qkv.trained import fingerprint, load_trained

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A LoRA run saved as qkv finetune saves one (its base a small Hugging Face folder), made in this process."""
    root = tmp_path_factory.mktemp("export-adapters")
    base = chat_folder(root / "base")
    pre = load_pretrained(base, weights="none")
    add_lora(pre.model, LoRAConfig(rank=4, alpha=8.0))
    torch.manual_seed(0)
    for layer in lora_layers(pre.model).values():
        torch.nn.init.normal_(layer.lora_B, std=0.02)
    meta = {"task": "finetune", "base": {"source": str(base), "weights": "none", "fingerprint": fingerprint(str(base))}}
    save_checkpoint(root / "made" / "best", pre.model, tokenizers={"text": pre.tokenizer}, meta=meta)
    return root / "made"


@pytest.fixture
def run(made, tmp_path):
    """A copy of the run to damage (its base named by absolute path, so the copy loads it too)."""
    import shutil

    return shutil.copytree(made, tmp_path / "run")


def _export(here, run, out, *extra):
    return here("export", "--model", run, *extra, "--out", out, cwd=out.parent)


def _set_weights(run, edit) -> None:
    """Change the run's adapter weights and record the new checksum: only what the weights hold is then wrong."""
    adapter = run / "best" / "adapter"
    tensors = load_file(adapter / WEIGHTS)
    edit(tensors)
    save_file(tensors, adapter / WEIGHTS)
    config = json.loads((run / "best" / "config.json").read_text())
    config[CHECKSUM] = file_sha256(adapter / WEIGHTS)
    (run / "best" / "config.json").write_text(json.dumps(config))


def test_the_adapters_export_for_peft_as_they_load(here, run, tmp_path):
    assert _export(here, run, tmp_path / "peft", "--format", "peft").returncode == 0
    config, tensors = read_peft_adapter(tmp_path / "peft")
    assert config.rank == 4 and tensors.keys() == load_file(run / "best" / "adapter" / WEIGHTS).keys()
    assert load_trained(run).model is not None


def test_adapters_that_are_not_finite_are_not_exported(here, run, tmp_path):
    _set_weights(run, lambda t: next(iter(t.values())).view(-1).__setitem__(0, float("nan")))
    last_line_error(_export(here, run, tmp_path / "peft", "--format", "peft"), "not finite")
    assert not (tmp_path / "peft").exists()


def test_a_link_in_the_run_s_adapter_folder_is_never_followed(here, run, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"peft_type": "LORA", "secret": "outside the run"}')
    config = run / "best" / "adapter" / CONFIG
    secret.write_text(config.read_text())  # a valid config: only the link itself is refused
    config.unlink()
    os.symlink(secret, config)
    last_line_error(_export(here, run, tmp_path / "peft", "--format", "peft"), "symbolic links", CONFIG)
    assert not (tmp_path / "peft").exists()


def test_peft_is_told_the_hugging_face_id_of_a_base_qkv_knows_by_name(here, run, tmp_path):
    config_path = run / "best" / "adapter" / CONFIG
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"base_model_name_or_path": "smollm2"}))
    assert _export(here, run, tmp_path / "peft", "--format", "peft").returncode == 0
    written = json.loads((tmp_path / "peft" / CONFIG).read_text())
    assert written["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_full_disk_while_merging_is_one_line_naming_the_folder_and_leaves_nothing(here, run, tmp_path,
                                                                                  monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        raise SafetensorError("Error while serializing: IoError(Custom { kind: WriteZero, error: \"failed to write "
                              "whole buffer: 3145728 requested and 687728 written\" })")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "merged"
    last_line_error(_export(here, run, out, "--merge"), str(out), "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_an_os_error_of_a_full_disk_says_so_too(tmp_path):
    from qkv.files import write_atomically

    def full(tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'out'}: No space left on device") as err:
        write_atomically(tmp_path / "out", full, folder=True)
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_merging_checks_the_adapters_checksum_as_loading_does(here, run, tmp_path):
    """--merge loads the run through the one door: adapters changed since the save are refused, not merged."""
    adapter = run / "best" / "adapter" / WEIGHTS
    tensors = load_file(adapter)
    next(iter(tensors.values())).mul_(2)
    save_file(tensors, adapter)
    last_line_error(_export(here, run, tmp_path / "merged", "--merge"), "corrupted or was changed since it was saved")
    assert not (tmp_path / "merged").exists()
