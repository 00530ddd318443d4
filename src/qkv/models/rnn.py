"""The LSTM encoder-decoder that came before the Transformer, with and without attention.

    source ─ embed ─ (bi)LSTM ─┬─ h_1 … h_S  every encoder state ──────────────┐ attention (dot / additive)
                               └─ final (h, c) ─ bridge ─ s_0                   │ or the one context vector
    target ─ embed ─ LSTM, one step at a time: s_t = LSTM([e(y_{t-1}); c_t], s_{t-1}) ─ tanh(W_o[s_t; c_t; e])
                                                                                         ─ softmax ─ p(y_t)

Without attention (Cho et al. 2014) the decoder sees the source only through one context vector ``c``, the
encoder's final state, fed at every step: the whole sentence must squeeze through a fixed number of floats,
however long it is (the *information bottleneck*). With attention (Bahdanau et al. 2015) the context is
recomputed at every step as a weighted average of *all* encoder states,

    α_ti = softmax_i score(s_{t-1}, h_i),   c_t = Σ_i α_ti h_i,

so each target word can look back at the source words it needs. Two scores:

* scaled dot product, s·h / √d (Luong et al. 2015; the Transformer's, with no parameters of its own);
* additive, vᵀ tanh(W_q s + W_k h) (Bahdanau et al. 2015): a one-hidden-layer network with a learned v.

Training feeds the true previous token (teacher forcing), or with probability 1 - ratio the model's own
previous prediction (scheduled sampling, Bengio et al. 2015). Decoding carries the state (h, c) from step to
step, so a step costs one LSTM step whatever the prefix; :class:`LSTMDecoding` (from
:meth:`LSTMSeq2Seq.start_decoding`) plugs it into the greedy and beam search of :mod:`qkv.generation`, shared
with the Transformer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..config import RNNConfig
from ..nn import padding_mask, scaled_dot_product_attention
from . import common
from .common import WithAttention


def lstm_step(lstm: nn.LSTM, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One time step of a (stacked, one-directional) ``nn.LSTM``, written out with its own weights:

        i = σ(W_ii x + b_ii + W_hi h + b_hi)     input gate: how much of the candidate to write
        f = σ(W_if x + b_if + W_hf h + b_hf)     forget gate: how much of the old cell to keep
        g = tanh(W_ig x + b_ig + W_hg h + b_hg)  candidate cell content
        o = σ(W_io x + b_io + W_ho h + b_ho)     output gate: how much of the cell to show
        c' = f ⊙ c + i ⊙ g,    h' = o ⊙ tanh(c')

    Each layer's h' is the next layer's x (with ``lstm.dropout`` in between while training), exactly as
    ``lstm(x[:, None], state)`` computes it. For one step at a time this is faster than ``nn.LSTM`` on a CPU,
    whose oneDNN kernel has a large fixed cost per call.

    Shape:
        x ``(B, input_size)``, state (h, c) each ``(num_layers, B, H)`` -> top layer's h' ``(B, H)`` and the
        new (h, c).
    """
    h, c = state
    hs, cs = [], []
    for layer in range(lstm.num_layers):
        if layer and lstm.dropout:
            x = F.dropout(x, lstm.dropout, training=lstm.training)
        w_ih, w_hh, b_ih, b_hh = (getattr(lstm, f"{name}_l{layer}") for name in ("weight_ih", "weight_hh",
                                                                                 "bias_ih", "bias_hh"))
        gates = x @ w_ih.T + b_ih + h[layer] @ w_hh.T + b_hh  # (B, 4H): PyTorch's order i, f, g, o
        i, f, g, o = gates.chunk(4, dim=-1)
        c_new = torch.sigmoid(f) * c[layer] + torch.sigmoid(i) * torch.tanh(g)
        x = torch.sigmoid(o) * torch.tanh(c_new)  # h'
        hs.append(x)
        cs.append(c_new)
    return x, (torch.stack(hs), torch.stack(cs))


def masked_softmax(scores: Tensor, mask: Tensor | None) -> Tensor:
    """softmax over the last dimension, giving masked positions (``mask`` False) exactly zero weight.

    As in :func:`qkv.nn.scaled_dot_product_attention`, masked scores get the most negative finite value, not
    -inf, so a row with nothing to attend to gets all-zero weights rather than NaN.
    """
    if mask is None:
        return scores.softmax(dim=-1)
    weights = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(dim=-1)
    return weights.masked_fill(~mask, 0.0)


class DotProductAttention(nn.Module):
    """score(s, h_i) = s · h_i / √d: how well the decoder state and an encoder state align; no parameters.

    Shape:
        query ``(B, d)``, keys and values ``(B, S, d)``, mask ``(B, S)`` -> context ``(B, d)``, weights ``(B, S)``.
    """

    def project_keys(self, memory: Tensor) -> Tensor:
        """The keys are the encoder states themselves."""
        return memory

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        if query.size(-1) != keys.size(-1):
            raise ValueError(f"dot-product attention needs queries and keys of one width, got {query.size(-1)} "
                             f"and {keys.size(-1)}")
        context, weights = scaled_dot_product_attention(
            query[:, None], keys, values, None if mask is None else mask[:, None]
        )  # (B, 1, d), (B, 1, S)
        return context[:, 0], weights[:, 0]


class AdditiveAttention(nn.Module):
    """score(s, h_i) = vᵀ tanh(W_q s + W_k h_i) (Bahdanau et al. 2015, "concat" in Luong et al.).

    A small network with one tanh layer of ``attention_dim`` units scores each pair; v, a learned vector,
    reads the score off that layer. W_k h_i does not depend on the decoder step, so it is computed once per
    sentence (:meth:`project_keys`) and only W_q s at every step.

    Shape:
        query ``(B, query_size)``, keys ``(B, S, attention_dim)`` (from :meth:`project_keys`), values
        ``(B, S, d)``, mask ``(B, S)`` -> context ``(B, d)``, weights ``(B, S)``.
    """

    def __init__(self, query_size: int, key_size: int, attention_dim: int) -> None:
        super().__init__()
        self.query_proj = nn.Linear(query_size, attention_dim, bias=False)  # W_q
        self.key_proj = nn.Linear(key_size, attention_dim, bias=False)  # W_k
        self.v = nn.Linear(attention_dim, 1, bias=False)  # v

    def project_keys(self, memory: Tensor) -> Tensor:
        return self.key_proj(memory)  # (B, S, A)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        hidden = torch.tanh(keys + self.query_proj(query)[:, None])  # (B, S, A)
        weights = masked_softmax(self.v(hidden).squeeze(-1), mask)  # (B, S)
        context = (weights[:, None] @ values)[:, 0]  # (B, 1, S) @ (B, S, d) -> (B, d)
        return context, weights


class Bridge(nn.Module):
    """From a bidirectional encoder's final states to the first state of a one-directional decoder:

        s_0 = tanh(W_h [h→; h←] + b_h),   c_0 = W_c [c→; c←] + b_c,

    one layer at a time (the same W for every layer). h is squashed as an LSTM's h always is; the cell c is
    not bounded, so it is mapped linearly. Bahdanau et al. started the decoder from tanh(W h←_1) alone.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.h = nn.Linear(hidden_size, hidden_size)
        self.c = nn.Linear(hidden_size, hidden_size)

    def forward(self, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, c = state  # (L, B, H) each, the two directions side by side
        return torch.tanh(self.h(h)), self.c(c)


class LSTMEncoder(nn.Module):
    """Embedding, then a (bidirectional) LSTM over the source.

    The forward LSTM reads x_1 … x_S, the backward one x_S … x_1; the state of position i is both side by
    side, h_i = [h→_i; h←_i], so it summarises the words on both sides of x_i. Padded positions are packed
    away: the backward LSTM starts at each sentence's own last word, the final states are those at each
    sentence's end, and a padded batch encodes each sentence exactly as it would alone.

    Shape:
        src ``(B, S)`` right-padded, mask ``(B, S)`` -> outputs ``(B, S, H)`` (zero at padding) and the final
        ``(h, c)``, each ``(n_layers, B, H)``, the two directions of a layer side by side.
    """

    def __init__(self, *, embedding: nn.Embedding, lstm: nn.LSTM, dropout: float = 0.0) -> None:
        super().__init__()
        if not lstm.batch_first:
            raise ValueError("the encoder's LSTM must be batch_first=True")
        self.embedding, self.lstm, self.dropout = embedding, lstm, nn.Dropout(dropout)

    def forward(self, src: Tensor, mask: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, s = src.shape
        lengths = torch.full((b,), s) if mask is None else mask.sum(dim=1).cpu()
        x = self.dropout(self.embedding(src))  # (B, S, E)
        # An empty source still reads one (padding) token: packing needs a length >= 1.
        packed = pack_padded_sequence(x, lengths.clamp(min=1), batch_first=True, enforce_sorted=False)
        out, (h, c) = self.lstm(packed)  # h, c: (L * directions, B, H / directions)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=s)  # (B, S, H)
        if self.lstm.bidirectional:
            h, c = (torch.cat([t[0::2], t[1::2]], dim=-1) for t in (h, c))  # (L, B, H): [forward; backward]
        return out, (h, c)


@dataclass
class LSTMState:
    """Everything the decoder carries from one step to the next.

    Only ``hidden`` changes from step to step; the rest is computed once per sentence by
    :meth:`LSTMSeq2Seq.encode`. Beam search reorders all of it row by row (:meth:`select`).

    Shape:
        hidden: (h, c), each ``(n_layers, B, H)``; memory ``(B, S, H)``; keys ``(B, S, H or attention_dim)``
        (None without attention); mask ``(B, S)`` (None without padding); context ``(B, H)``.
    """

    hidden: tuple[Tensor, Tensor]  # the decoder LSTM's (h, c) of every layer
    memory: Tensor  # every encoder state h_1 … h_S: what attention averages
    keys: Tensor | None  # memory as the attention's keys (W_k h_i for additive attention), computed once
    mask: Tensor | None  # True for real source tokens
    context: Tensor  # the encoder's final top-layer state: without attention, all the decoder sees

    @property
    def batch_size(self) -> int:
        return self.memory.size(0)

    def select(self, index: Tensor) -> LSTMState:
        """Keep (and duplicate) batch rows ``index``."""
        h, c = self.hidden

        def rows(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, index)

        return LSTMState((h.index_select(1, index), c.index_select(1, index)), rows(self.memory),
                            rows(self.keys), rows(self.mask), rows(self.context))


class LSTMDecoder(nn.Module):
    """An LSTM decoder that reads the source through an attention module, or through one fixed context vector
    when ``attention`` is None.

    At step t, from the previous token y_{t-1} and state s_{t-1}:

        c_t = Σ_i α_ti h_i with α_t = softmax(score(s_{t-1}, h_·))     (with attention; else c_t = c)
        s_t = LSTM([e(y_{t-1}); c_t], s_{t-1})
        o_t = tanh(W_o [s_t; c_t; e(y_{t-1})]),   p(y_t | y_<t, x) = softmax(W_y o_t)

    s_{t-1} is the top layer's h. Feeding c_t into both the LSTM and the output ("deep output") is what
    Cho et al. and Bahdanau et al. do; o_t is ``embedding_dim`` wide so W_y can be the embedding matrix.

    Args:
        embedding: the target embedding.
        lstm: ``batch_first`` LSTM with input ``embedding_dim + H`` and hidden size H.
        attention: :class:`DotProductAttention`, :class:`AdditiveAttention` or None (the bottleneck).
        pre_output: W_o, ``2H + embedding_dim -> embedding_dim``.
        out_proj: W_y, ``embedding_dim -> vocabulary``.
        dropout: on the embeddings and on o_t.
    """

    def __init__(self, *, embedding: nn.Embedding, lstm: nn.LSTM, attention: nn.Module | None,
                 pre_output: nn.Linear, out_proj: nn.Linear, dropout: float = 0.0) -> None:
        super().__init__()
        if not lstm.batch_first or lstm.bidirectional or lstm.proj_size or not lstm.bias:
            raise ValueError("the decoder's LSTM must be batch_first=True, one-directional, with biases and no "
                             "projection")
        self.embedding, self.lstm, self.attention = embedding, lstm, attention
        self.pre_output, self.out_proj, self.dropout = pre_output, out_proj, nn.Dropout(dropout)

    def _attend(self, state: LSTMState) -> tuple[Tensor, Tensor | None]:
        if self.attention is None:
            return state.context, None
        query = state.hidden[0][-1]  # (B, H): s_{t-1}, the top layer
        return self.attention(query, state.keys, state.memory, state.mask)

    def _recur(self, emb: Tensor, state: LSTMState) -> tuple[Tensor, Tensor, Tensor | None, LSTMState]:
        """One step of the recurrence: emb ``(B, E)`` -> s_t ``(B, H)``, c_t ``(B, H)``, α_t ``(B, S)``, state."""
        context, weights = self._attend(state)
        out, hidden = lstm_step(self.lstm, torch.cat([emb, context], dim=-1), state.hidden)  # (B, H)
        return out, context, weights, dataclasses.replace(state, hidden=hidden)

    def _logits(self, out: Tensor, context: Tensor, emb: Tensor) -> Tensor:
        """(..., H), (..., H), (..., E) -> logits (..., V)."""
        return self.out_proj(self.dropout(torch.tanh(self.pre_output(torch.cat([out, context, emb], dim=-1)))))

    def step(self, tokens: Tensor, state: LSTMState) -> tuple[Tensor, LSTMState, Tensor | None]:
        """One token per row: tokens ``(B,)`` -> logits ``(B, V)`` of the next, the new state, α_t ``(B, S)``."""
        emb = self.dropout(self.embedding(tokens))  # (B, E)
        out, context, weights, state = self._recur(emb, state)
        return self._logits(out, context, emb), state, weights

    def forward(self, tokens: Tensor, state: LSTMState, *,
                teacher_forcing: float = 1.0) -> tuple[Tensor, Tensor | None]:
        """Decode a whole target from ``state``: tokens ``(B, T)`` -> logits ``(B, T, V)``, weights ``(B, T, S)``.

        With ``teacher_forcing`` = 1 the input at step t is ``tokens[:, t]``; below 1, each row at each step
        t > 0 is fed, with probability 1 - teacher_forcing, the model's own most probable token of step t-1
        instead. Without attention and with full teacher forcing every input is known in advance, so the LSTM
        runs over the whole target in one call; :meth:`step` gives the same numbers one step at a time.
        """
        if not 0.0 <= teacher_forcing <= 1.0:
            raise ValueError(f"teacher_forcing must be in [0, 1], got {teacher_forcing}")
        b, t_len = tokens.shape
        emb = self.dropout(self.embedding(tokens))  # (B, T, E)
        if self.attention is None and teacher_forcing == 1.0:
            context = state.context[:, None].expand(-1, t_len, -1)  # (B, T, H): the same c at every step
            out, _ = self.lstm(torch.cat([emb, context], dim=-1), state.hidden)  # (B, T, H)
            return self._logits(out, context, emb), None
        outs, contexts, inputs, weights, logits = [], [], [], [], []
        for t in range(t_len):
            e_t = emb[:, t]  # (B, E)
            if t and teacher_forcing < 1.0:
                own = self.dropout(self.embedding(logits[-1].argmax(dim=-1)))  # (B, E): the model's guess
                truth = torch.rand(b, device=tokens.device) < teacher_forcing  # (B,)
                e_t = torch.where(truth[:, None], e_t, own)
            out, context, w, state = self._recur(e_t, state)
            if teacher_forcing < 1.0:  # the next input may depend on this step's prediction
                logits.append(self._logits(out, context, e_t))
            outs.append(out)
            contexts.append(context)
            inputs.append(e_t)
            weights.append(w)
        if logits:
            result = torch.stack(logits, dim=1)  # (B, T, V)
        else:  # the output layer in one batch for all steps
            result = self._logits(torch.stack(outs, dim=1), torch.stack(contexts, dim=1), torch.stack(inputs, 1))
        return result, None if self.attention is None else torch.stack(weights, dim=1)  # (B, T, S)


class LSTMSeq2Seq(common.Model):
    """The LSTM encoder-decoder configured by an :class:`RNNConfig`: the bottleneck model
    (``attention="none"``) or an attention model (``"dot"``, ``"additive"``).

    It offers what the Transformer offers to the training loop and the translator: ``forward(src, tgt)``
    for teacher-forced training, ``source_mask``, ``encode``/``decode``, attention weights in the
    Transformer's format, and :meth:`start_decoding` (an :class:`LSTMDecoding`) for greedy and beam search.

    Example:
        >>> cfg = RNNConfig(src_vocab_size=1000, tgt_vocab_size=1200, attention="additive")
        >>> logits = LSTMSeq2Seq(cfg)(src, tgt_in)  # (B, T_tgt, 1200)

    Shape:
        src ``(B, S)``, tgt ``(B, T)`` token ids, right-padded with ``pad_id`` -> logits ``(B, T, tgt_vocab_size)``.

    Attention maps:
        With ``return_attention=True`` (attention models only), :meth:`forward` and :meth:`decode` return a
        :class:`~qkv.models.common.WithAttention` ``(logits, {"decoder_cross": [w]})`` in the Transformer's
        format, one layer with one head: w ``(B, 1, T, S)``, row t the α_t that built c_t, a distribution over
        the source (zero on padding). The bottleneck model (``attention="none"``) has none and raises
        ``ValueError``.
    """

    def __init__(self, config: RNNConfig) -> None:
        super().__init__()
        cfg = self.config = config
        e, h = cfg.embedding_dim, cfg.hidden_size
        between_layers = cfg.dropout if cfg.n_layers > 1 else 0.0  # nn.LSTM's dropout acts between layers only
        src_emb = nn.Embedding(cfg.src_vocab_size, e)
        tgt_emb = src_emb if cfg.share_embeddings else nn.Embedding(cfg.tgt_vocab_size, e)
        directions = 2 if cfg.bidirectional else 1
        self.encoder = LSTMEncoder(
            embedding=src_emb,
            lstm=nn.LSTM(e, h // directions, cfg.n_layers, batch_first=True, bidirectional=cfg.bidirectional,
                         dropout=between_layers),
            dropout=cfg.dropout,
        )
        self.bridge = Bridge(h) if cfg.bidirectional else None
        attention: nn.Module | None = None
        if cfg.attention == "dot":
            attention = DotProductAttention()
        elif cfg.attention == "additive":
            attention = AdditiveAttention(h, h, cfg.attention_dim)
        self.decoder = LSTMDecoder(
            embedding=tgt_emb,
            lstm=nn.LSTM(e + h, h, cfg.n_layers, batch_first=True, dropout=between_layers),
            attention=attention,
            pre_output=nn.Linear(2 * h + e, e),
            out_proj=nn.Linear(e, cfg.tgt_vocab_size, bias=False),
            dropout=cfg.dropout,
        )
        for p in self.parameters():
            nn.init.uniform_(p, -cfg.init_range, cfg.init_range)
        if cfg.tie_output:
            self.decoder.out_proj.weight = tgt_emb.weight

    def source_mask(self, src: Tensor) -> Tensor | None:
        """``(B, S)`` boolean, True for real source tokens (None when the config has no pad_id)."""
        return None if self.config.pad_id is None else padding_mask(src, self.config.pad_id)

    def encode(self, src: Tensor) -> LSTMState:
        """Read the source once: source ids ``(B, S)`` -> the decoder's first state (see :class:`LSTMState`)."""
        common.check_ids(src, self.config.src_vocab_size, "src")
        mask = self.source_mask(src)
        memory, final = self.encoder(src, mask)  # (B, S, H), ((L, B, H), (L, B, H))
        context = final[0][-1]  # (B, H): the top layer's last state, the sentence in one vector
        hidden = self.bridge(final) if self.bridge is not None else final
        attention = self.decoder.attention
        keys = attention.project_keys(memory) if attention is not None else None
        return LSTMState(hidden, memory, keys, mask, context)

    @overload
    def decode(self, tgt: Tensor, state: LSTMState, *, teacher_forcing: float = 1.0,
               return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def decode(self, tgt: Tensor, state: LSTMState, *, teacher_forcing: float = 1.0,
               return_attention: Literal[True]) -> WithAttention: ...

    def decode(self, tgt: Tensor, state: LSTMState, *, teacher_forcing: float = 1.0,
               return_attention: bool = False) -> Tensor | WithAttention:
        """Target ids ``(B, T)`` from ``state`` (usually :meth:`encode`'s) -> logits ``(B, T, tgt_vocab_size)``;
        with ``return_attention``, ``WithAttention(logits, {"decoder_cross": [...]})`` (see the class docstring).
        See :meth:`LSTMDecoder.forward` for ``teacher_forcing``."""
        common.check_ids(tgt, self.config.tgt_vocab_size, "tgt")
        if tgt.size(0) != state.batch_size:
            raise ValueError(f"batch sizes differ: tgt has {tgt.size(0)} rows, the state {state.batch_size}")
        if return_attention and self.decoder.attention is None:
            raise ValueError("this LSTM has no attention (attention='none'): it reads one context vector; "
                             "attention maps need attention='dot' or 'additive'")
        logits, weights = self.decoder(tgt, state, teacher_forcing=teacher_forcing)  # (B, T, V), (B, T, S)
        if return_attention:
            return WithAttention(logits, {"decoder_cross": [weights[:, None]]})  # one layer, one head
        return logits

    def decode_step(self, tokens: Tensor, state: LSTMState) -> tuple[Tensor, LSTMState, Tensor | None]:
        """One token per row, ``(B,)`` -> next-token logits ``(B, V)``, the next state, weights ``(B, S)``."""
        return self.decoder.step(tokens, state)

    @overload
    def forward(self, src: Tensor, tgt: Tensor, *, teacher_forcing: float = 1.0,
                return_attention: Literal[False] = False) -> Tensor: ...
    @overload
    def forward(self, src: Tensor, tgt: Tensor, *, teacher_forcing: float = 1.0,
                return_attention: Literal[True]) -> WithAttention: ...

    def forward(self, src: Tensor, tgt: Tensor, *, teacher_forcing: float = 1.0,
                return_attention: bool = False) -> Tensor | WithAttention:
        """Encode, then decode the whole target (teacher forcing with probability ``teacher_forcing``): logits
        ``(B, T, tgt_vocab_size)``, or with ``return_attention`` ``WithAttention(logits, {"decoder_cross": [...]})``
        (see the class docstring)."""
        state = self.encode(src)
        if return_attention:
            return self.decode(tgt, state, teacher_forcing=teacher_forcing, return_attention=True)
        return self.decode(tgt, state, teacher_forcing=teacher_forcing)

    def start_decoding(self, src: Tensor, *, use_cache: bool = True) -> LSTMDecoding:
        """The source ``(B, S)`` encoded once, ready for :mod:`qkv.generation`'s greedy and beam search: the
        decoding adapter every encoder-decoder model offers (see :class:`LSTMDecoding`)."""
        return LSTMDecoding(self, src, use_cache=use_cache)


class LSTMDecoding:
    """An :class:`LSTMSeq2Seq` as :mod:`qkv.generation` sees every model (an ``IncrementalDecoder``): the source
    encoded once, then one step per token with the state (h, c) carried forward; beam search reorders the
    state, the encoder outputs and the source mask together.

    Without the cache (``use_cache=False``) every step re-runs the decoder from the encoder's state over the
    whole prefix, as a model without a carried state would: the reference the carried state is checked
    against.
    """

    def __init__(self, model: LSTMSeq2Seq, src: Tensor, *, use_cache: bool = True) -> None:
        self.model = model
        self.state = model.encode(src)
        self.use_cache = use_cache
        self.prefix: Tensor | None = None
        self.batch_size, self.device = src.size(0), src.device

    def step(self, tokens: Tensor) -> Tensor:
        """tokens ``(B, t)``: the newest tokens -> logits ``(B, V)`` of the next one."""
        if not self.use_cache:
            self.prefix = tokens if self.prefix is None else torch.cat([self.prefix, tokens], dim=1)
            return self.model.decode(self.prefix, self.state)[:, -1]
        logits = None
        for t in range(tokens.size(1)):
            logits, self.state, _ = self.model.decode_step(tokens[:, t], self.state)
        if logits is None:
            raise ValueError("step() needs at least one token per row")
        return logits

    def reorder(self, index: Tensor) -> None:
        """Keep (and duplicate) batch rows ``index``."""
        self.state = self.state.select(index)
        if self.prefix is not None:
            self.prefix = self.prefix.index_select(0, index)
        self.batch_size = index.numel()


__all__ = ["AdditiveAttention", "Bridge", "DotProductAttention", "LSTMDecoder", "LSTMDecoding", "LSTMEncoder",
           "LSTMSeq2Seq", "LSTMState", "lstm_step", "masked_softmax"]
