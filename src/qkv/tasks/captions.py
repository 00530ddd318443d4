"""Captions made from class labels, for training a CLIP on a labelled image set (Fashion-MNIST has no captions).

A caption is a template with a wording of the class put in: ``"a grey picture of someone's {}."`` with
``"trainers"``. Every class has several wordings and there are many templates; some of both are kept out of
training and used only to evaluate, so a zero-shot score measures whether the text encoder learnt what the words
mean rather than memorised the training sentences:

- *held-out templates* never appear in a training caption (the headline zero-shot accuracy uses them, with the
  class's name: its first wording);
- one *held-out wording* per class (``"jumper"`` for Pullover) appears in no training caption either; a text
  encoder can place it only from its pieces, so its score is a harder, secondary figure.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

# Fashion-MNIST's classes in label order: the name (what zero-shot classifies by), more wordings for training,
# and one wording held out of training.
FASHION_WORDINGS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("t-shirt", ("top", "tee", "short-sleeved top", "tank top"), "t-shirt top"),
    ("trousers", ("pants", "pair of trousers", "jeans", "slacks"), "pair of pants"),
    ("pullover", ("sweater", "knit sweater", "long-sleeved sweater"), "jumper"),
    ("dress", ("frock", "gown", "summer dress"), "long dress"),
    ("coat", ("jacket", "overcoat", "winter coat"), "winter jacket"),
    ("sandal", ("sandals", "flip-flop", "open shoe"), "summer sandal"),
    ("shirt", ("button-up shirt", "blouse", "collared shirt"), "long-sleeved shirt"),
    ("sneaker", ("trainers", "running shoe", "sports shoe"), "running sneaker"),
    ("bag", ("handbag", "purse", "tote bag"), "leather bag"),
    ("ankle boot", ("boot", "short boot", "bootie"), "leather boot"),
)
TRAIN_TEMPLATES = (
    "a photo of a {}.", "a picture of a {}.", "a black-and-white photo of a {}.", "a low-resolution image of a {}.",
    "a {}.", "this is a {}.", "a product photo of a {}.", "a grey picture of someone's {}.", "an image showing a {}.",
    "a small photo of the {}.", "a cropped photo of a {}.", "a {} on a black background.", "a shop photo of a {}.",
    "someone's {}.", "a tiny picture of a {}.", "the {} in a photo.",
)
HELD_OUT_TEMPLATES = (
    "a blurry photo of a {}.", "there is a {} in this picture.", "a close-up photo of the {}.",
    "a catalogue picture of a {}.", "a dark image of a {}.", "a photo of my {}.",
)


def check_template(template: str, what: str = "template") -> str:
    """``template`` if it has exactly one ``{}``, where a label goes (literal braces written ``{{`` and ``}}``),
    so that ``template.format(label)`` works; ``what`` names it in the error (``"--template"``).

    Raises:
        ValueError: for no hole, several, a named or numbered one (``{label}``, ``{0}``), a conversion or format
            spec, or a lone brace.
    """
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as err:  # a lone { or }
        raise ValueError(f"{what} {template!r} is not a template ({err}): write the label's place as {{}} and a "
                         "literal brace as {{ or }}") from None
    if not fields:
        raise ValueError(f"{what} {template!r} has no {{}} where the label goes, e.g. 'a photo of a {{}}.'")
    if fields != [("", "", None)]:
        holes = ", ".join("{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
                          for name, spec, conv in fields)
        raise ValueError(f"{what} {template!r} must have exactly one {{}} where the label goes (it has {holes}), "
                         "e.g. 'a photo of a {}.'; write a literal brace as {{ or }}")
    return template


@dataclass(frozen=True)
class CaptionSet:
    """Wordings per class and templates, split into what training sees and what only evaluation sees."""

    names: tuple[str, ...]  # one per class: what zero-shot classification uses
    train_wordings: tuple[tuple[str, ...], ...]  # per class, the name first
    held_out_wordings: tuple[str, ...]  # per class
    train_templates: tuple[str, ...]
    held_out_templates: tuple[str, ...]

    @classmethod
    def fashion(cls) -> CaptionSet:
        return cls(names=tuple(name for name, _, _ in FASHION_WORDINGS),
                   train_wordings=tuple((name, *more) for name, more, _ in FASHION_WORDINGS),
                   held_out_wordings=tuple(out for _, _, out in FASHION_WORDINGS),
                   train_templates=TRAIN_TEMPLATES, held_out_templates=HELD_OUT_TEMPLATES)

    @classmethod
    def from_names(cls, names: list[str]) -> CaptionSet:
        """Captions for any labelled images (a folder of class subfolders): the folder names as the only wording,
        the same templates."""
        words = tuple(name.replace("_", " ").lower() for name in names)
        return cls(names=words, train_wordings=tuple((w,) for w in words), held_out_wordings=words,
                   train_templates=TRAIN_TEMPLATES, held_out_templates=HELD_OUT_TEMPLATES)

    def training_text(self) -> list[str]:
        """Every training caption once (what the tokenizer learns from)."""
        return [t.format(w) for t in self.train_templates for ws in self.train_wordings for w in ws]

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator, held_out: bool = False) -> list[str]:
        """One random caption per label: a training template and wording, or (``held_out``) a held-out template
        and a training wording."""
        templates = self.held_out_templates if held_out else self.train_templates
        t = torch.randint(len(templates), (len(labels),), generator=generator).tolist()
        w = torch.randint(1 << 30, (len(labels),), generator=generator).tolist()
        return [templates[ti].format(self.train_wordings[y][wi % len(self.train_wordings[y])])
                for y, ti, wi in zip(labels.tolist(), t, w, strict=True)]
