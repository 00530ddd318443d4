"""`qkv demo` end to end with a tiny budget: it trains, scores held-out pairs, draws, and leaves a usable model."""

from qkv.checkpoint import load_checkpoint
from qkv.tasks.demo import run_demo
from qkv.tasks.translation import translate


def test_demo_runs_end_to_end(tmp_path, capsys):
    result = run_demo(out=tmp_path / "demo", minutes=0.15, progress=False)
    assert set(result) >= {"exact_match", "bleu", "train_minutes", "steps"} and result["steps"] > 0
    for name in ("attention.png", "loss.png", "log.csv", "best/model.safetensors", "last/trainer_state.pt"):
        assert (tmp_path / "demo" / name).stat().st_size > 0, name
    printed = capsys.readouterr().out
    assert "exact match" in printed and "March 3, 2021" in printed
    model = load_checkpoint(tmp_path / "demo")
    assert len(translate(model.model, model.tokenizers, ["May 17, 1990"])) == 1


def test_a_rerun_never_overwrites_an_earlier_model(tmp_path):
    from qkv.tasks.demo import _free_directory

    (tmp_path / "demo" / "best").mkdir(parents=True)
    assert _free_directory(tmp_path / "demo") == tmp_path / "demo-2"
    assert _free_directory(tmp_path / "other") == tmp_path / "other"
