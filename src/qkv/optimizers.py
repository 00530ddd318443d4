"""The optimizers a run can train with: AdamW alone, or Muon for the hidden matrices and AdamW for the rest.

**AdamW** (``--optimizer adamw``) scales each weight's step by a running estimate of its gradient's size, and
decays the weights apart from the gradient. Biases and norm gains (every 1-D parameter) get no decay: decay
pulls a gain towards 0, where a norm's output vanishes.

**Muon** (``--optimizer muon``; Jordan et al., 2024, the optimizer of the GPT-2 speedruns) treats a hidden
layer's weight matrix W as what it is, a linear map, and asks for the step that changes that map the most for a
given size of change *as a map* (its spectral norm), not entry by entry. That step is the momentum of the
gradient, M = U S Vᵀ, with its singular values all set to one: U Vᵀ, "orthogonalised". Computing an SVD every
step is too slow, so Muon runs five Newton–Schulz iterations X ← a X + b (X Xᵀ) X + c (X Xᵀ)² X from
X₀ = M / ‖M‖ (coefficients (3.4445, −4.7750, 2.0315), picked to push every singular value towards 1 fast,
landing between about 0.7 and 1.2). Rare directions of the gradient then move as fast as common ones,
which is where Muon's head start over AdamW comes from. The step is scaled by sqrt(max(1, rows / columns)) so a
wide and a tall matrix move alike, with Nesterov momentum 0.95 and the same decoupled weight decay as AdamW.

:class:`Muon` is ``torch.optim.Muon``'s update (the tests hold it to it), with two differences that matter on
a CPU: the iterations run in fp32 there (bf16 on a GPU: ``torch.optim.Muon`` always uses bf16, which costs a
second a step on a CPU without native bf16, against milliseconds in fp32), and the matrices of one shape
(every layer's Q, K, V and output projections) are orthogonalised together, as one batch.

Muon is only for the matrices inside the layer stacks: the projections of attention (Q, K, V, output), of the
feed-forward network, and of Swin's patch merging. The embeddings (a lookup, not a map), the output layer and
classification heads (their rows are classes, each needing its own scale), norms, biases, the patch embedding's
convolution and CLIP's projections keep AdamW. Each optimizer has its own learning rate (``--lr`` for AdamW,
``--muon-lr`` for Muon); the schedule multiplies both by the same factor, step by step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

OPTIMIZERS = ("adamw", "muon")
MUON_MOMENTUM = 0.95  # Nesterov momentum of Muon's updates (the speedruns' and torch.optim.Muon's)


def hidden_matrices(model: nn.Module) -> list[Tensor]:
    """The weights Muon trains: every ``nn.Linear`` weight inside attention, a feed-forward network or a patch
    merging, each once (a shared module counts once)."""
    from .models.swin import PatchMerging
    from .nn import FeedForward, MultiHeadAttention

    seen: dict[int, Tensor] = {}
    for module in model.modules():
        if isinstance(module, MultiHeadAttention | FeedForward | PatchMerging):
            for inner in module.modules():
                if isinstance(inner, nn.Linear) and inner.weight.requires_grad:
                    seen.setdefault(id(inner.weight), inner.weight)
    return list(seen.values())


def build_optimizer(model: nn.Module, *, kind: str = "adamw", lr: float, muon_lr: float = 0.02,
                    betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0):
    """AdamW over every trainable parameter, or (``kind="muon"``) Muon over :func:`hidden_matrices` and AdamW
    over the rest; no weight decay on 1-D parameters. The result steps, zeroes and saves as one optimizer."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {kind!r}")
    muon = hidden_matrices(model) if kind == "muon" else []
    if kind == "muon" and not muon:
        raise ValueError(f"--optimizer muon trains the matrices of attention and feed-forward layers, and "
                         f"{type(model).__name__} has none; use --optimizer adamw")
    taken = {id(p) for p in muon}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    decay = [p for p in rest if p.dim() >= 2]
    no_decay = [p for p in rest if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates all parameters in one pass: ~15% of a small model's step time on a CPU.
    adamw = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-9, fused=True)
    if kind == "adamw":
        return adamw
    return Paired(muon=Muon(muon, lr=muon_lr, weight_decay=weight_decay), adamw=adamw)


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalise(m: Tensor, steps: int = NS_STEPS) -> Tensor:
    """U Vᵀ of M = U S Vᵀ, approximately (singular values land in about 0.7–1.2): Newton–Schulz iterations
    X ← a X + (b A + c A²) X with A = X Xᵀ, on the wide orientation (A is the smaller Gram matrix), from
    X₀ = M / ‖M‖ so that every singular value starts at most 1. ``m`` is a batch (n, rows, columns)."""
    a, b, c = NS_COEFFICIENTS
    tall = m.size(-2) > m.size(-1)
    x = m.mT if tall else m
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):  # three matrix products a step, the scalings folded into them
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon over 2-D weights: Nesterov momentum, orthogonalised (:func:`orthogonalise`), scaled by
    sqrt(max(1, rows / columns)), after decoupled weight decay. State per weight: ``momentum_buffer``."""

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = MUON_MOMENTUM) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        for group in self.param_groups:
            if any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon trains 2-D weight matrices only; give the rest to AdamW")

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            by_shape: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                by_shape.setdefault((p.shape, p.device), []).append((p, p.grad.add(buf, alpha=group["momentum"])))
            for (shape, device), pairs in by_shape.items():
                dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
                ortho = orthogonalise(torch.stack([u for _, u in pairs]).to(dtype))
                scale = group["lr"] * max(1.0, shape[0] / shape[1]) ** 0.5
                for (p, _), o in zip(pairs, ortho, strict=True):
                    p.mul_(1 - group["lr"] * group["weight_decay"]).add_(o.to(p.dtype), alpha=-scale)


class Paired:
    """Two optimizers over disjoint parameters, used as one: ``param_groups`` lists both's groups (Muon's first),
    ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` do both. What a gradient scaler and the
    trainer's schedule need of an optimizer, nothing more."""

    def __init__(self, **parts: torch.optim.Optimizer) -> None:
        self.parts = parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts.values() for group in part.param_groups]

    def step(self, closure=None) -> None:
        for part in self.parts.values():
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.parts):
            raise ValueError(f"the saved optimizer state holds {sorted(state)[:4]}, not {sorted(self.parts)}: "
                             "the run was trained with another --optimizer")
        for name, part in self.parts.items():
            part.load_state_dict(state[name])
