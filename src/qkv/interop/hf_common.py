"""What the Hugging Face converters share (``hf_gpt``, ``hf_bert``, ``hf_vit``, ``hf_swin``, ``hf_clip``): reading a
config's fields, checking that a config can hold a family's weights, handing a state dict out tensor by tensor
while collecting every problem for one error, and, for the vision families, their activations, image sides,
layers and the backbone-or-classifier loader.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..config import GPTConfig, ModelConfig
from ..footprint import build_model

# Hugging Face activation names -> qkv's, for the vision families (ViT, Swin, CLIP).
ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}

_MISSING = object()


def hf_field(hf_config: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    """``hf_config[key]``, or ``default``; a required key that is absent (or null) is a ValueError."""
    value = hf_config.get(key)
    if value is not None:
        return value
    if default is _MISSING:
        raise ValueError(f"the Hugging Face config (model_type={hf_config.get('model_type')!r}) has no {key!r}")
    return default


def check_config(cfg: ModelConfig, checkpoint: str, **allowed: tuple[Any, ...]) -> None:
    """The config fields a checkpoint family fixes; a config that disagrees could not hold its weights."""
    wrong = [
        f"{name}={getattr(cfg, name)!r} (expected {' or '.join(map(repr, values))})"
        for name, values in allowed.items()
        if getattr(cfg, name) not in values
    ]
    if wrong:
        raise ValueError(f"this config cannot hold a {checkpoint} checkpoint: {', '.join(wrong)}")


# What a training run sets and a model's weights do not depend on: an export writes it but need not keep it
TRAINING_FIELDS = ("dropout", "attention_dropout", "activation_dropout", "patch_dropout", "init", "init_std")


def check_written(ours: Mapping[str, Any], read_back: Mapping[str, Any], family: str, *,
                  ignore: Collection[str] = ()) -> None:
    """An export's config, read back by qkv's reader (``read_back``), must hold every field of the model's
    (``ours``, as dicts), those of training and in ``ignore`` aside: one that would come back different is an
    error naming it, not a silent change of the model."""
    skipped = {*TRAINING_FIELDS, *ignore}
    lost = [f"{k}={str(v)[:40]}" for k, v in ours.items() if k in read_back and k not in skipped and read_back[k] != v]
    if lost:
        raise ValueError(f"a Hugging Face {family} config cannot hold {', '.join(lost)}")


class HFStateDict:
    """A Hugging Face state dict handed out tensor by tensor, collecting every problem for one error.

    Names are canonicalised on the way in: the model prefix (``transformer.``, ``model.``, ``bert.``) is
    dropped, ``rename`` is applied, and buffers for which ``ignore`` is true are left out.
    """

    def __init__(
        self,
        state_dict: Mapping[str, Tensor],
        *,
        family: str,
        prefix: str,
        ignore: Callable[[str], bool],
        rename: Callable[[str], str] | None = None,
    ) -> None:
        self.family = family
        self.tensors: dict[str, Tensor] = {}
        self.given_names: dict[str, str] = {}  # canonical name -> the name in the state dict
        for name, tensor in state_dict.items():
            key = name.removeprefix(prefix)
            if rename is not None:
                key = rename(key)
            if ignore(key):
                continue
            if key in self.tensors:
                raise ValueError(f"{name!r} and {self.given_names[key]!r} both name the tensor {key!r}; keep one")
            self.tensors[key], self.given_names[key] = tensor, name
        self.used: set[str] = set()
        self.missing: list[str] = []
        self.problems: list[str] = []

    def take(self, key: str, shape: tuple[int, ...], *, required: bool = True) -> Tensor | None:
        """The tensor ``key`` if present with ``shape``; otherwise None, and the problem is recorded."""
        if key not in self.tensors:
            if required:
                self.missing.append(key)
            return None
        self.used.add(key)
        tensor = self.tensors[key]
        if tuple(tensor.shape) != tuple(shape):
            self.problems.append(f"{self.given_names[key]} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
            return None
        return tensor

    def layers(self, prefix: str, count: int) -> range:
        """The indices of ``count`` layers named ``{prefix}{i}.``, once the tensors are seen to hold that many: a
        config that claims 10⁹ layers fails here, not a billion steps on."""
        held = {match[1] for key in self.tensors if (match := re.match(rf"{re.escape(prefix)}(\d+)\.", key))}
        if count > len(held):
            raise ValueError(f"the config states {count} layers but the {self.family} tensors hold {len(held)}; the "
                             "config does not belong to these weights")
        return range(count)

    def output_head(self, key: str, cfg: GPTConfig, embedding: Tensor | None) -> Tensor | None:
        """The output projection: its own tensor, or the token embedding when the config ties them."""
        shape = (cfg.vocab_size, cfg.d_model)
        if not cfg.tie_embeddings:
            return self.take(key, shape)
        head = self.take(key, shape, required=False)  # tied checkpoints may store it again, or not at all
        if head is not None and embedding is not None and not torch.equal(head, embedding):
            self.problems.append(
                f"{self.given_names[key]} differs from the token embedding, but the config ties them "
                "(tie_embeddings=True); build the config with tie_embeddings=False"
            )
        return embedding

    def finish(self, converted: dict[str, Tensor | None]) -> dict[str, Tensor]:
        """Raise if anything was missing, misshapen or left over; else the converted tensors."""
        problems = []
        if self.missing:
            problems.append(f"missing {_listed(self.missing)}")
        problems += self.problems[:8] + [f"and {len(self.problems) - 8} more misshapen"] * (len(self.problems) > 8)
        unexpected = [self.given_names[key] for key in self.tensors if key not in self.used]
        if unexpected:
            problems.append(f"unexpected {_listed(unexpected)}")
        if problems:
            raise ValueError(f"cannot convert the {self.family} state dict: " + "; ".join(problems))
        return {name: tensor for name, tensor in converted.items() if tensor is not None}


def _listed(names: list[str], most: int = 8) -> str:
    """Names for a message: all of them, or the first ``most`` and how many more (a model of 64 experts a layer
    misses thousands of tensors at once)."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{names[:most]}{more}"


def image_side(value: int | list[int]) -> int:
    """An image or patch size, given as one side or as (height, width) of a square."""
    return value if isinstance(value, int) else value[0]


def take_layer(ckpt: HFStateDict, names: Mapping[str, str], hf: str, qkv: str, width: int, d_ff: int
               ) -> dict[str, Tensor | None]:
    """One layer's weights and biases (Pre- or Post-Norm alike), ``names`` mapping Hugging Face modules (under
    ``hf``) to qkv's (under ``qkv``): norms ``(width,)``, the MLP's up ``(d_ff, width)`` and down ``(width,
    d_ff)``, every projection ``(width, width)``."""
    shapes = {"feed_forward.up": (d_ff, width), "feed_forward.down": (width, d_ff)}
    out = {}
    for hf_name, qkv_name in names.items():
        weight_shape = (width,) if qkv_name.endswith("norm") else shapes.get(qkv_name, (width, width))
        for part, shape in (("weight", weight_shape), ("bias", weight_shape[:1])):
            out[f"{qkv}{qkv_name}.{part}"] = ckpt.take(f"{hf}{hf_name}.{part}", shape)
    return out


def load_image_model(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any], config_from_hf: Callable,
                      state_dict_from_hf: Callable, backbone: type[nn.Module],
                      classifier: tuple[type[nn.Module], str]) -> nn.Module:
    """The backbone, or, with a ``classifier.*`` layer in the state dict, the classifier (its class, and the
    attribute holding its backbone) with that layer as its head; strictly loaded, in eval mode."""
    head = {name.removeprefix("classifier."): t for name, t in state_dict.items() if name.startswith("classifier.")}
    n_classes = head["weight"].size(0) if "weight" in head else None
    cfg = config_from_hf(hf_config, n_classes=n_classes)
    converted = state_dict_from_hf(state_dict, cfg)
    model = build_model(classifier[0] if n_classes else backbone, cfg, what="the Hugging Face model",
                        initialise=False)  # every weight is loaded next (strictly)
    if n_classes:
        converted = {f"{classifier[1]}.{name}": t for name, t in converted.items()}
        converted |= {"head.weight": head["weight"], "head.bias": head.get("bias")}
    model.load_state_dict(converted, strict=True)
    return model.eval()


__all__ = ["ACTIVATIONS", "HFStateDict", "check_config", "check_written", "hf_field", "image_side", "load_image_model",
           "take_layer"]
