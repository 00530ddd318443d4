"""Training recipes: one class per way to train a model from the command line (``qkv train NAME``), over one
base (:class:`qkv.recipes.base.Recipe`) that starts the run, builds or resumes the model, trains and reports.

=============  =========================================  ==========================================
``qkv train``  recipe                                     module
=============  =========================================  ==========================================
translation    the encoder-decoder Transformer, or LSTMs  :mod:`qkv.recipes.translation`
lm             a GPT language model                       :mod:`qkv.recipes.language_model`
mlm            BERT by masked-language modelling          :mod:`qkv.recipes.masked_lm`
classify       a BERT sentence classifier                 :mod:`qkv.recipes.classify`
vit, swin      image classifiers                          :mod:`qkv.recipes.image_classifier`
clip           image and text encoders, contrastively     :mod:`qkv.recipes.clip`
=============  =========================================  ==========================================

Each recipe's settings are a dataclass (its defaults, written once; ``--help`` shows them from there). Nothing
here imports torch until a recipe runs.
"""

from .base import Recipe
from .classify import ClassifyRecipe
from .clip import CLIPRecipe
from .image_classifier import SwinRecipe, ViTRecipe
from .language_model import LanguageModelRecipe
from .masked_lm import MaskedLMRecipe
from .translation import TranslationRecipe

RECIPES: dict[str, type[Recipe]] = {r.name: r for r in (TranslationRecipe, LanguageModelRecipe, MaskedLMRecipe,
                                                          ClassifyRecipe, ViTRecipe, SwinRecipe, CLIPRecipe)}

__all__ = ["RECIPES", "Recipe"]
