"""Pictures people would rather see than read: attention heatmaps, attention over images and loss curves (PNG,
via matplotlib).

Chinese labels need a font with CJK glyphs; the first installed one of :data:`CJK_FONTS` is used (on Debian:
``apt-get install fonts-wqy-microhei``). Without one the plot is still written, with a warning, and the
missing glyphs show as boxes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .files import write_atomically

log = logging.getLogger(__name__)

CJK_FONTS = ("WenQuanYi Micro Hei", "WenQuanYi Zen Hei", "Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC",
             "SimHei", "Microsoft YaHei", "PingFang SC", "AR PL UMing CN")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _needs_cjk(labels: Sequence[str]) -> bool:
    return any(ord(ch) > 0x2E80 and ch != "▁" for label in labels for ch in label)


def _font_family(labels: Sequence[str]) -> list[str] | None:
    if not _needs_cjk(labels):
        return None
    name = _cjk_font()
    if name is None:
        _warn_no_cjk_font()
        return None
    return [name, "DejaVu Sans"]


@functools.cache
def _cjk_font() -> str | None:
    """The first of :data:`CJK_FONTS` that matplotlib can use. matplotlib keeps its list of fonts in a cache
    made the first time it ran, so a font installed after that is not in it: the system's font files
    (fontconfig's list) that the cache lacks are added before giving up."""
    from matplotlib import font_manager

    manager = font_manager.fontManager
    found = _first_cjk(manager)
    if found is None:
        known = {f.fname for f in manager.ttflist}
        for path in font_manager.findSystemFonts():
            if path not in known:
                with contextlib.suppress(Exception):  # a file matplotlib cannot parse is simply not a candidate
                    manager.addfont(path)
        found = _first_cjk(manager)
    return found


def _first_cjk(manager) -> str | None:
    installed = {f.name for f in manager.ttflist}
    return next((name for name in CJK_FONTS if name in installed), None)


@functools.cache
def _warn_no_cjk_font() -> None:
    """Once per process (matplotlib itself would warn once per missing glyph, see attention_heatmap)."""
    log.warning("no CJK font installed (tried %s, in matplotlib's font list and the system's font files); "
                "Chinese labels will show as boxes. On Debian: apt-get install fonts-wqy-microhei",
                ", ".join(CJK_FONTS[:3]))


def attention_heatmap(
    weights: torch.Tensor,
    query_labels: Sequence[str],
    key_labels: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
    xlabel: str = "source",
    ylabel: str = "target",
) -> Path:
    """Write a heatmap of ``weights`` ``(T_q, T_k)``: one row per query (output token), one column per key.

    Raises:
        ValueError: if the labels do not match the weights' shape.
    """
    weights = weights.detach().float().cpu()
    if weights.dim() != 2 or weights.shape != (len(query_labels), len(key_labels)):
        raise ValueError(f"weights of shape {tuple(weights.shape)} do not match {len(query_labels)} query and "
                         f"{len(key_labels)} key labels")
    plt = _pyplot()
    family = _font_family([*query_labels, *key_labels])
    height, width = weights.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * width + 2), max(3.0, 0.4 * height + 1.5)))
    image = ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, aspect="auto")
    font = {"family": family} if family else {}
    ax.set_xticks(range(width), [s.replace("▁", "") or "▁" for s in key_labels], rotation=60, ha="right", **font)
    ax.set_yticks(range(height), [s.replace("▁", "") or "▁" for s in query_labels], **font)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, **font)
    fig.colorbar(image, ax=ax, fraction=0.04)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # without a CJK font: the one notice above, not a warning per glyph
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path


def expert_routing(experts: torch.Tensor, labels: Sequence[str], path: str | Path, *, n_experts: int,
                   title: str = "") -> Path:
    """Write which expert each token went to, layer by layer: ``experts`` ``(layers, T)``, each token's first
    choice, a colour per expert and its number in the cell; one column per token (``labels``).

    Raises:
        ValueError: if the labels do not match the tokens.
    """
    experts = experts.detach().cpu()
    if experts.dim() != 2 or experts.size(1) != len(labels):
        raise ValueError(f"experts of shape {tuple(experts.shape)} do not match {len(labels)} token labels")
    plt = _pyplot()
    family = _font_family(labels)
    layers, tokens = experts.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * tokens + 2), max(2.5, 0.45 * layers + 1.5)))
    ax.imshow(experts.numpy(), cmap="tab20" if n_experts > 10 else "tab10", vmin=0, vmax=max(n_experts - 1, 1),
              aspect="auto", interpolation="nearest")
    if tokens * layers <= 2000:  # the numbers, where they fit
        for (layer, token), expert in zip(torch.cartesian_prod(torch.arange(layers), torch.arange(tokens)).tolist(),
                                          experts.flatten().tolist(), strict=True):
            ax.text(token, layer, str(expert), ha="center", va="center", fontsize=7, color="white")
    font = {"family": family} if family else {}
    ax.set_xticks(range(tokens), [s.replace("▁", "") or "▁" for s in labels], rotation=60, ha="right", **font)
    ax.set_yticks(range(layers), [f"layer {i}" for i in range(layers)])
    ax.set_xlabel("token")
    ax.set_title(title or f"first-choice expert of each token (of {n_experts})", **font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path


def image_attention(image: torch.Tensor, maps: torch.Tensor, rollout: torch.Tensor, path: str | Path, *,
                    title: str = "") -> Path:
    """Write the [CLS] token's attention over an image: the image, the rollout laid over it, then one small map
    per layer (rows) and head (columns), each over the image and scaled to its own maximum.

    Args:
        image: uint8 ``(C, H, W)``, 1 or 3 channels.
        maps: ``(n_layers, n_heads, rows, cols)`` (see :func:`qkv.tasks.image_attention.cls_attention`).
        rollout: ``(rows, cols)`` (see :func:`qkv.tasks.image_attention.attention_rollout`).

    Raises:
        ValueError: maps and rollout on different grids, or an image that is not ``(C, H, W)``.
    """
    if image.dim() != 3 or maps.dim() != 4 or maps.shape[2:] != rollout.shape:
        raise ValueError(f"need an image (C, H, W), maps (L, H, rows, cols) and a rollout (rows, cols), got "
                         f"{tuple(image.shape)}, {tuple(maps.shape)}, {tuple(rollout.shape)}")
    plt = _pyplot()
    layers, heads = maps.shape[:2]
    picture = image.permute(1, 2, 0).squeeze(-1).cpu().numpy()
    grey = {"cmap": "gray", "vmin": 0, "vmax": 255} if picture.ndim == 2 else {}
    extent = (0, image.size(2), image.size(1), 0)  # the patch grid stretched over the pixels

    def overlay(ax, weights: torch.Tensor, label: str, size: int) -> None:
        ax.imshow(picture, **grey, extent=extent)
        ax.imshow(weights.detach().float().cpu().numpy(), cmap="inferno", alpha=0.65, extent=extent, vmin=0,
                  interpolation="nearest")
        ax.set_title(label, fontsize=size)

    cols = max(heads, 2)
    fig = plt.figure(figsize=(1.3 * cols + 0.4, 1.3 * layers + 3.2))
    grid = fig.add_gridspec(layers + 2, cols, height_ratios=[2.2, 0.15] + [1] * layers)
    top = fig.add_subplot(grid[0, : cols // 2])
    top.imshow(picture, **grey)
    top.set_title("image", fontsize=9)
    overlay(fig.add_subplot(grid[0, cols // 2 :]), rollout, "rollout (all layers)", 9)
    for layer in range(layers):
        for head in range(heads):
            overlay(fig.add_subplot(grid[layer + 2, head]), maps[layer, head], f"L{layer} H{head}", 7)
    for ax in fig.axes:
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png"))
    plt.close(fig)
    return path


def loss_curves(rows: Sequence[Mapping[str, str]], path: str | Path, *, title: str = "", unit: str = "tokens"
                ) -> Path:
    """Plot ``train_loss`` and ``val_loss`` (and a validation metric on a second axis) against ``step`` from
    the rows of a training log (CSV rows as dicts; empty cells are skipped). The legend sits below the axes, so
    it never hides a curve, and every point has a marker, so a short run's one evaluation is still visible.
    ``unit`` is what the loss is averaged over (a task's ``unit``: "tokens", "images", "pairs", ...)."""
    plt = _pyplot()
    fig = loss_figure(rows, title=title, unit=unit)
    path = Path(path)
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png"))
    plt.close(fig)
    return path


def loss_figure(rows: Sequence[Mapping[str, str]], *, title: str = "", unit: str = "tokens"):
    """The figure :func:`loss_curves` saves (a matplotlib ``Figure``)."""
    plt = _pyplot()

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(float(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("train_loss", "val_loss"):
        xs, ys = series(key)
        if xs:
            marker = "o" if key == "val_loss" or len(xs) <= 30 else ""
            ax.plot(xs, ys, marker=marker, label=key.replace("_", " "), markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy (nats per {unit.replace('_', ' ').removesuffix('s')})")
    ax.grid(alpha=0.3)
    metric = next((k for k in ("val_bleu", "val_accuracy", "val_exact", "val_rewards/accuracies")
                   if any(r.get(k) for r in rows)), None)
    handles, labels = ax.get_legend_handles_labels()
    if metric:
        twin = ax.twinx()
        xs, ys = series(metric)
        (line,) = twin.plot(xs, ys, "s--", color="tab:green", markersize=4, label=metric.replace("_", " "))
        twin.set_ylabel(metric.replace("_", " "))
        handles.append(line)
        labels.append(line.get_label())
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(handles), frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
