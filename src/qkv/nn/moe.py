"""A mixture of experts: E feed-forward networks, and a router that sends each token to k of them.

    p      = softmax(x W_r)                       the router's probabilities over the E experts     (E,)
    top    = the k experts of largest p            (renormalised to sum to 1, or as they are)
    MoE(x) = Σ_{e ∈ top} p_e · FFN_e(x)   [+ σ(x w_s) · FFN_shared(x)]

Each expert is the position-wise feed-forward network of :mod:`qkv.nn.feedforward` (SwiGLU in the families that
use them); the model holds E networks' parameters and spends k networks' work per token (Shazeer et al. 2017;
Switch Transformer, Fedus et al. 2021; Mixtral). Qwen2-MoE adds a shared expert that every token goes through,
weighted by a sigmoid gate.

The work is done expert by expert on the tokens routed to it (the tokens sorted by expert, one product per expert
with its rows): k experts' work per token, and an expert no token chose is never read. Finding the experts' row
counts reads them back to the host, as every PyTorch MoE without a grouped kernel does.

Training spreads tokens over experts with the Switch Transformer's balancing loss, E · Σ_e f_e · P_e (f_e: the
share of routed slots that went to e, P_e: the mean router probability of e), and the router z-loss, the mean of
(log Σ exp(router logits))², which keeps the router's logits small (ST-MoE, Zoph et al. 2022).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .feedforward import FeedForward, StackedFeedForward


class Router(nn.Module):
    """Scores the experts for each token and keeps the k best.

    Args:
        d_model: token width.
        n_experts: E.
        top_k: k, the experts each token goes to (1 <= k <= E).
        normalize: renormalise the k kept probabilities to sum to 1 (Mixtral, Qwen3-MoE's default; OLMoE's and
            Qwen2-MoE's are kept as the softmax over all E gave them).

    Shape:
        x ``(N, d_model)`` -> weights ``(N, k)``, experts ``(N, k)`` (long), logits ``(N, E)``.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, *, normalize: bool = True) -> None:
        super().__init__()
        check_experts(n_experts, top_k)
        self.n_experts, self.top_k, self.normalize = n_experts, top_k, normalize
        self.proj = nn.Linear(d_model, n_experts, bias=False)  # W_r

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.proj(x)  # (N, E)
        probs = logits.float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k) each
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.type_as(x), experts, logits


def check_experts(n_experts: int, top_k: int) -> None:
    """E >= 1 experts and 1 <= k <= E, checked before anything is built."""
    for name, value in (("n_experts", n_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} routes each token to more experts than there are (n_experts={n_experts})")


class MoEFeedForward(nn.Module):
    """The feed-forward sub-layer as a mixture of experts (see the module's text).

    Args:
        d_model: token width.
        d_ff: each expert's hidden width.
        n_experts: E.
        top_k: k.
        activation: the experts' activation (a gated one: swiglu in Mixtral, Qwen-MoE, OLMoE, Granite-MoE).
        normalize: renormalise the k routing weights (see :class:`Router`).
        shared_d_ff: the hidden width of an expert every token goes through, weighted by ``σ(x w_s)`` (Qwen2-MoE);
            None: no shared expert.
        bias: biases in the experts' layers.

    After each forward, ``router_logits`` ``(N, E)`` holds the router's logits of its tokens, for the balancing
    losses (:func:`balancing_loss`, :func:`router_z_loss`), and ``routed`` the experts each token went to ``(N, k)``.

    Shape:
        ``(B, T, d_model)`` -> ``(B, T, d_model)``.
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, *, activation: str = "swiglu",
                 normalize: bool = True, shared_d_ff: int | None = None, bias: bool = False) -> None:
        super().__init__()
        self.router = Router(d_model, n_experts, top_k, normalize=normalize)
        self.experts = nn.ModuleList(FeedForward(d_model, d_ff, activation=activation, bias=bias)
                                     for _ in range(n_experts))
        self.shared = None if shared_d_ff is None else FeedForward(d_model, shared_d_ff, activation=activation,
                                                                   bias=bias)
        self.shared_gate = None if shared_d_ff is None else nn.Linear(d_model, 1, bias=False)  # w_s
        self.router_logits: Tensor | None = None
        self.routed: Tensor | None = None
        self._decode: tuple[tuple, Callable | None] | None = None  # (what it was made for, the kernel's step)

    @property
    def n_experts(self) -> int:
        return self.router.n_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, D)
        weights, experts, self.router_logits = self.router(tokens)  # (N, k), (N, k), (N, E)
        self.routed = experts
        out = self._dispatch(tokens, weights, experts)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(tokens)) * self.shared(tokens)
        return out.reshape(shape)

    def _dispatch(self, tokens: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Σ over each token's k experts of weight · expert(token), an expert at a time on its own rows."""
        k = experts.size(1)
        if tokens.size(0) == 1:  # one token (decoding): its k experts in turn, no sorting
            step = self._kernel_step()
            if step is not None:
                return step(tokens, weights, experts)
            out = None
            for slot, e in enumerate(experts[0].tolist()):
                done = self.experts[e](tokens) * weights[:, slot : slot + 1]
                out = done if out is None else out + done
            return out.to(tokens.dtype)
        flat = experts.flatten()  # (N k,): slot i is token i // k's (i % k)-th expert
        order = flat.argsort(stable=True)  # the slots grouped by expert
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()  # the rows of each expert, on the host
        rows = order // k  # the token of each sorted slot
        slot_weights = weights.flatten()[order, None]  # (N k, 1)
        out = torch.zeros_like(tokens)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                picked = rows[start : start + count]
                done = expert(tokens.index_select(0, picked)) * slot_weights[start : start + count]
                out.index_add_(0, picked, done.to(out.dtype))
            start += count
        return out

    def _forget_product(self) -> None:
        """The kernel's decoding step is made again at the next use (the experts' weights moved)."""
        self._decode = None

    def _kernel_step(self) -> Callable | None:
        """The decoding step of :func:`picked_step` when the experts' layers run as one product (made once for these
        experts where they lie; None otherwise, or while training)."""
        if torch.is_grad_enabled():
            return None
        key = (*map(id, self.experts), self.experts[0].gate_up.codes.data_ptr()
               if hasattr(getattr(self.experts[0], "gate_up", None), "codes") else None)
        if self._decode is None or self._decode[0] != key:
            self._decode = (key, picked_step(self.experts))
        return self._decode[1]


def picked_step(experts: nn.ModuleList) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    """A decoding step's k experts in two products, ``(token (1, d), weights (1, k), picked (1, k)) -> (1, d)``:
    the gate and up projections of the token's input (quantized once), then each expert's down projection of its
    own hidden row, each product running all k experts at once. It is made where every expert is a stacked gated
    network whose layers' class can run the layers a row picks as one product (a ``picked`` class method: qkv's
    kernel's 4-bit layers, :class:`qkv.kernel_layers.KernelInt4Linear`); None otherwise. The numbers are those of
    the experts one by one (the same blocks times the same int8 activations), summed in another order."""
    if not all(type(e) is StackedFeedForward for e in experts):
        return None
    picked = getattr(type(experts[0].gate_up), "picked", None)
    gate_up = None if picked is None else picked([e.gate_up for e in experts])
    down = None if gate_up is None else picked([e.down for e in experts])
    if down is None:
        return None
    first = experts[0]

    def step(token: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        ids = chosen.reshape(-1).contiguous()
        hidden = first.activate(gate_up(token.float().contiguous(), ids, True)).contiguous()  # (k, ff)
        return torch.mm(weights.float(), down(hidden, ids, False)).to(token.dtype)  # Σ_j w_j · down_j(h_j)

    return step


def balancing_loss(router_logits: list[Tensor], top_k: int) -> Tensor:
    """The Switch Transformer's load-balancing loss over every layer's router logits ``(N, E)`` together:
    E · Σ_e f_e · P_e, where f_e is the share of the tokens' k slots routed to expert e (a mean over the k ranks)
    and P_e the mean probability the router gave e; at its least, k, when the experts share the tokens and the
    probability evenly (transformers' ``load_balancing_loss_func``)."""
    logits = torch.cat([r.float() for r in router_logits])  # (L N, E)
    n_experts = logits.size(-1)
    probs = logits.softmax(dim=-1)
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, n_experts).float()  # (L N, k, E)
    share = chosen.mean(dim=0)  # (k, E): of the tokens' r-th slots, the share that went to e
    return n_experts * (share * probs.mean(dim=0)).sum()


def router_z_loss(router_logits: list[Tensor]) -> Tensor:
    """ST-MoE's router z-loss: the mean over tokens of (log Σ_e exp(logit_e))²."""
    logits = torch.cat([r.float() for r in router_logits])
    return torch.logsumexp(logits, dim=-1).square().mean()


__all__ = ["MoEFeedForward", "Router", "balancing_loss", "check_experts", "picked_step", "router_z_loss"]
