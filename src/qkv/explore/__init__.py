"""The attention explorer: every layer and head of a qkv model, in a browser, offline (``qkv explore``).

* :mod:`.results`: a model run on one input, its attention weights as plain data for the page;
* :mod:`.page`: the one self-contained HTML page (its script and style inlined), with or without a result in it;
* :mod:`.server`: a small local web server that runs the model for the page.
"""

from .page import page
from .results import InputError, encoder_result, image_result, lm_result, translation_result

__all__ = ["InputError", "encoder_result", "image_result", "lm_result", "page", "translation_result"]
