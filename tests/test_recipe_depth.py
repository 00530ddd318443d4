"""The speedrun recipes' depth follows the time they are given (``Recipe.LAYERS_BY_MINUTES``): the GPT has two
layers under 4 minutes, the ViT six from 20 minutes on; the preset's depth otherwise (None below), a typed
--n-layers wins, and the classic recipes keep their own presets at any budget."""

import pytest
from clitools import recipe_settings

from qkv.recipes.image_classifier import DEEPER_FROM_MINUTES, ViTRecipe
from qkv.recipes.language_model import SHALLOW_BELOW_MINUTES, LanguageModelRecipe

CASES = {
    "gpt": (LanguageModelRecipe, "train lm", [(None, None, None), (0.5, None, 2), (3.9, None, 2), (4, None, None),
                                              (60, None, None), (1, 3, 3)]),
    "vit": (ViTRecipe, "train vit", [(None, None, None), (10, None, None), (19.9, None, None), (20, None, 6),
                                     (30, None, 6), (30, 3, 3)]),
}


def test_the_thresholds_are_the_documented_ones():
    assert (SHALLOW_BELOW_MINUTES, DEEPER_FROM_MINUTES) == (4, 20)


@pytest.mark.parametrize("family, minutes, typed, layers",
                         [(family, *case) for family, (_, _, cases) in CASES.items() for case in cases])
def test_the_speedrun_depth_follows_the_budget_unless_told(family, minutes, typed, layers):
    recipe_cls, command, _ = CASES[family]
    for recipe, expected in ((None, layers), ("classic", typed)):
        settings = recipe_settings(recipe_cls, command, max_minutes=minutes, n_layers=typed, recipe=recipe)
        assert settings["n_layers"] == expected
