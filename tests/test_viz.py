"""Pictures: the loss curve's legend never hides a curve, a short run's points are visible, and a missing CJK
font is said once, not once per glyph."""

import logging
import warnings

import pytest
import torch

from qkv.viz import attention_heatmap, loss_curves, loss_figure

ROWS = [{"step": "50", "train_loss": "3.1"}, {"step": "100", "train_loss": "2.5"},
        {"step": "100", "val_loss": "2.6", "val_bleu": "12.5"}]


def test_the_legend_sits_outside_the_axes():
    fig = loss_figure(ROWS, title="run")
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    plot_area = ax.get_window_extent()
    assert legend.y1 <= plot_area.y0  # below the axes: it cannot cross the BLEU line or a loss curve
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train loss", "val loss", "val bleu"]


def test_a_single_evaluation_has_a_visible_marker():
    fig = loss_figure([{"step": "3", "val_loss": "2.0", "val_exact": "0.5"}])
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    assert lines and all(line.get_marker() not in ("", "None", None) for line in lines)


def test_short_training_curves_show_their_points():
    fig = loss_figure(ROWS[:2])
    assert fig.axes[0].get_lines()[0].get_marker() == "o"


def test_a_missing_cjk_font_is_said_once(tmp_path, caplog):
    labels = ["年", "月", "日"]
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="qkv.viz"):
        warnings.simplefilter("always")
        for i in range(2):
            attention_heatmap(torch.full((3, 3), 1 / 3), labels, labels, tmp_path / f"a{i}.png")
        loss_curves(ROWS, tmp_path / "loss.png")
    assert not [w for w in caught if "Glyph" in str(w.message)]
    assert len([r for r in caplog.records if "CJK" in r.getMessage()]) <= 1


def test_a_cjk_font_installed_after_matplotlibs_cache_is_found(monkeypatch):
    """matplotlib caches its font list when it first runs; a font installed later (the README's order: run
    the demo, then install the font) must still be found, not reported missing."""
    import pytest
    from matplotlib import font_manager

    from qkv import viz

    manager = font_manager.fontManager
    if viz._first_cjk(manager) is None:
        pytest.skip("no CJK font installed (apt-get install fonts-wqy-microhei)")
    cjk_files = {f.fname for f in manager.ttflist if f.name in viz.CJK_FONTS}
    stale = [f for f in manager.ttflist if f.fname not in cjk_files]  # the cache as it was before the font
    monkeypatch.setattr(manager, "ttflist", stale)
    viz._cjk_font.cache_clear()
    try:
        assert viz._font_family(["年"]) is not None
    finally:
        viz._cjk_font.cache_clear()


def test_the_loss_axis_names_what_the_loss_is_averaged_over():
    assert loss_figure(ROWS).axes[0].get_ylabel() == "cross-entropy (nats per token)"
    assert loss_figure(ROWS, unit="images").axes[0].get_ylabel() == "cross-entropy (nats per image)"
    assert loss_figure(ROWS, unit="target_tokens").axes[0].get_ylabel() == "cross-entropy (nats per target token)"


def test_expert_routing_draws_a_cell_per_layer_and_token(tmp_path):
    from qkv.viz import expert_routing

    experts = torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0]])
    path = expert_routing(experts, ["a", "b", "c", "猫"], tmp_path / "routing.png", n_experts=4)
    assert path.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="do not match 3 token labels"):
        expert_routing(experts, ["a", "b", "c"], tmp_path / "bad.png", n_experts=4)
