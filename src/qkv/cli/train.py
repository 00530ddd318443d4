"""``qkv train RECIPE``: one nested subcommand per training recipe (:mod:`qkv.recipes`), each with the parser
of its module here; ``qkv train`` without a recipe is ``qkv train translation``."""

from __future__ import annotations

import argparse

from ..recipes import RECIPES
from . import bert, lm, translation, vision
from .common import add_recipe_argument, command

# Each recipe's options, added to its parser with the recipe's settings dataclass (which holds the defaults).
ARGUMENTS = {"translation": translation.add_train_arguments, "lm": lm.add_train_arguments,
             "mlm": bert.add_mlm_arguments, "classify": bert.add_classify_arguments, "vit": vision.add_vit_arguments,
             "swin": vision.add_swin_arguments, "clip": vision.add_clip_arguments}
DEFAULT = "translation"


def add_commands(sub) -> None:
    train = command(sub, "train", f"train a model with a recipe: {', '.join(RECIPES)} ({DEFAULT} when none is "
                                  "named)")
    recipes = train.add_subparsers(dest="trainer", required=True, metavar="RECIPE")
    for name, recipe in RECIPES.items():
        p = recipes.add_parser(name, help=recipe.summary, description=f"Train {recipe.summary}.")
        ARGUMENTS[name](p, recipe.Settings)
        if len(recipe.RECIPES) > 1:
            add_recipe_argument(p, recipe.RECIPES)
        p.set_defaults(run=recipe.main, command=recipe.command)


def with_default_recipe(argv: list[str]) -> list[str]:
    """``argv`` with the default recipe named after a bare ``qkv train`` (``qkv train --src ...``)."""
    at = next((i for i, word in enumerate(argv) if not word.startswith("-")), None)
    if at is None or argv[at] != "train":
        return argv
    after = argv[at + 1 : at + 2]
    if after and (after[0] in RECIPES or after[0] in ("-h", "--help")):
        return argv
    return [*argv[: at + 1], DEFAULT, *argv[at + 1 :]]


def parsers(parser: argparse.ArgumentParser):
    """``parser`` and every parser nested in it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from parsers(child)
