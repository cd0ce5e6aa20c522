"""The handle a patched rotary embedding returns in place of ``(cos, sin)``
(rotary.integrations.transformers): the positions of one forward pass and
the table, which the patched rotation functions (_hf_functions) turn into
one op call."""

from typing import Any, Optional, Tuple

import torch

from .._ops import apply_qk_norm_rope, apply_rope, apply_rope_qk
from ..module import RotaryEmbedding
from . import _hf_functions, _qk_norm
from ._rope_state import _RopeState

# The ops the handles call; module attributes so that tests can count calls.
_apply_qk, _apply_one, _apply_fused = apply_rope_qk, apply_rope, apply_qk_norm_rope


def _layout(unsqueeze_dim: int) -> str:
    if unsqueeze_dim not in _hf_functions.LAYOUTS:
        raise ValueError(f"rotary: apply_rotary_pos_emb with unsqueeze_dim={unsqueeze_dim} is not supported")
    return _hf_functions.LAYOUTS[unsqueeze_dim]


class RotaryPositions:
    """What a patched rotary embedding returns twice in place of ``(cos,
    sin)``: the ``position_ids`` of one forward pass and the rotary table to
    use. Only the patched ``apply_rotary_pos_emb`` understands it; any other
    use (arithmetic other than ``-sin``, indexing other than the forms
    ``__getitem__`` names) raises."""

    __slots__ = ("_root", "_state", "_held", "_negated", "_steps")

    def __init__(self, position_ids: torch.Tensor, state: _RopeState, negated: bool = False,
                 steps: Tuple[tuple, ...] = (), held: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        self._root = position_ids  # the forward pass's
        self._state = state
        # A host-driven rule's tables of this forward pass (_RopeState.held):
        # recomputed under gradient checkpointing, it rotates as it did.
        self._held = held
        self._negated = negated
        # The indexing since: ("tokens", a, b), ("sequence", b), ("select",
        # tokens), ("batch",), applied when positions are read. A cos and a sin
        # indexed alike pair up (_conjugate); indexing itself runs no tensor op
        # (called from code dynamo runs eagerly, it compiles no graph).
        self._steps = steps

    @property
    def position_ids(self) -> torch.Tensor:
        pos = self._root
        for step in self._steps:  # none but in Qwen4-Exp's indexing
            if step[0] == "tokens":
                pos = pos[..., step[1]:step[2]]
            elif step[0] == "sequence":
                pos = pos[..., step[1], :]
            elif step[0] == "select":
                pos = pos.index_select(-1, step[1])
            else:  # "batch"
                pos = pos.unsqueeze(-2)
        return pos

    @property
    def _rows(self) -> bool:
        """cos[b] picked one sequence of the batch: the handle stands for [tokens, dim]."""
        if not self._steps:  # every family's call but Qwen4-Exp's indexing
            return False
        kinds = [step[0] for step in self._steps]
        return "sequence" in kinds and "batch" not in kinds

    def _derived(self, *step: Any) -> "RotaryPositions":
        return RotaryPositions(self._root, self._state, self._negated, self._steps + (step,), self._held)

    def __neg__(self) -> "RotaryPositions":
        # (cos, -sin) is the inverse rotation: DeepSeek-V4 turns its attention
        # output back with it (its k is its v).
        return RotaryPositions(self._root, self._state, not self._negated, self._steps, self._held)

    def _same_view(self, other: "RotaryPositions") -> bool:
        def same(a: Any, b: Any) -> bool:
            return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)

        return (self._root is other._root and len(self._steps) == len(other._steps)
                and all(len(x) == len(y) and all(map(same, x, y)) for x, y in zip(self._steps, other._steps)))

    def _conjugate(self, sin: Any) -> bool:
        """Whether (self, sin), as a patched function got them for (cos, sin),
        is the inverse rotation: (h, -h). Any other pair raises."""
        if sin is self and not self._negated:  # (h, h): the patched embedding returned one handle twice
            return False
        paired = sin is None or (isinstance(sin, RotaryPositions) and sin._state is self._state
                                 and self._same_view(sin))
        if self._negated or not paired:
            raise TypeError("rotary: a patched apply_rotary_pos_emb takes the (cos, sin) pair of one patched rotary "
                            "embedding call, or (cos, -sin) for the inverse rotation; got "
                            f"({'-' if self._negated else ''}{self!r}, {sin!r})")
        return sin is not None and sin._negated

    @property
    def rope(self) -> RotaryEmbedding:
        return self._state.rope

    def __getitem__(self, index: Any) -> "RotaryPositions":
        # cos[..., :n] with n >= the rotated width is the same rotation
        # (MiniMax-M3's indexer cuts the pair to its own head_dim).
        cut = index[1] if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis else None
        if (isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1)
                and (cut.stop is None or (isinstance(cut.stop, int) and cut.stop >= self.rope.dim))):
            return self
        # Qwen4-Exp's pair covers its whole position history ([batch, tokens, dim]):
        # cos[:, a:b(, :)] keeps those tokens, cos[b] one sequence of the batch.
        whole = lambda i: isinstance(i, slice) and i == slice(None)  # noqa: E731
        if not self._rows and isinstance(index, tuple) and len(index) in (2, 3) and whole(index[0]) \
                and isinstance(index[1], slice) and index[1].step in (None, 1) and all(map(whole, index[2:])):
            return self._derived("tokens", index[1].start, index[1].stop)
        if not self._rows and isinstance(index, int) and not isinstance(index, bool):
            return self._derived("sequence", index)
        raise TypeError(f"rotary: the patched rotary embedding's (cos, sin) cannot be indexed by {index!r} "
                        f"(only [..., :n] with n >= its rotary dim {self.rope.dim}, [:, a:b], [:, a:b, :] and "
                        "[b] of the pair, and index_select(0, tokens) of [b])")

    def index_select(self, dim: int, index: torch.Tensor) -> "RotaryPositions":
        """cos[b].index_select(0, tokens) (Qwen4-Exp's indexer): those tokens' positions."""
        if not self._rows or dim not in (0, -2):
            raise TypeError(f"rotary: index_select({dim}, ...) of the patched rotary embedding's (cos, sin): only "
                            "index_select(0, tokens) of one sequence's pair, cos[b]")
        return self._derived("select", index)

    def _batched(self) -> "RotaryPositions":
        """A [tokens, dim] handle as a batch of one."""
        return self._derived("batch")

    def apply(self, q: torch.Tensor, k: torch.Tensor, unsqueeze_dim: int = 1,
              interleaved: Optional[bool] = None, sin: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (``[batch, heads, seq, head_dim]``, or ``[batch, seq,
        heads, head_dim]`` for ``unsqueeze_dim=2``) with our kernel; interleaved:
        the calling function's pairing where it is not the rope's; sin: the
        handle the function got as sin (``-sin``: the inverse rotation)."""
        if self._rows:
            raise ValueError("rotary: one sequence's (cos, sin), cos[b], rotates one tensor at a time")
        layout = _layout(unsqueeze_dim)
        freqs, kw = self._args(q, self._conjugate(sin))
        interleaved = self.rope.interleaved if interleaved is None else interleaved
        fused = _qk_norm.take(q, k)  # the q/k norms deferred to here (fuse_qk_norm)
        if q.dtype != k.dtype:  # autocast: bf16 q, float32 k (HY-V4's indexer); HF's formula promotes
            common = torch.promote_types(q.dtype, k.dtype)
            q, k = q.to(common), k.to(common)
        if fused is None:
            return _apply_qk(q, k, freqs, 0, interleaved, layout=layout, **kw)
        sq, sk = fused
        kind = _qk_norm.norm_kind(sq, q, layout)
        if _qk_norm.norm_kind(sk, k, layout) != kind:
            raise RuntimeError("rotary: q_norm and k_norm cover different dims; patch with fuse_qk_norm=False")
        if sq.eps != sk.eps:
            raise RuntimeError(f"rotary: q_norm and k_norm have different eps ({sq.eps} and {sk.eps}), and the fused "
                               "norm takes one; patch with fuse_qk_norm=False")
        return _apply_fused(q, k, freqs, 0, interleaved, layout=layout, q_weight=sq.weight,
                            k_weight=sk.weight, eps=sq.eps, norm=kind, weight_offset=sq.offset, **kw)

    def apply_one(self, x: torch.Tensor, unsqueeze_dim: int = 2, interleaved: Optional[bool] = None,
                  sin: Any = None) -> torch.Tensor:
        """The per-tensor form: rotate ``x`` alone, laid out as in :meth:`apply`
        (GPT-J's ``[batch, seq, heads, rotary_dim]``; Gemma 3n / 4 rotate q and
        k apart, and q only on KV-shared layers; DeepSeek-V4 its q, its kv and,
        inversely, its attention output)."""
        if self._rows:  # cos[b]...: x is [tokens, heads, head_dim], the pair unsqueezed at 1
            if unsqueeze_dim != 1 or x.dim() != 3:
                raise ValueError(f"rotary: one sequence's (cos, sin) rotates [tokens, heads, head_dim] with "
                                 f"unsqueeze_dim=1, got shape {tuple(x.shape)} and unsqueeze_dim={unsqueeze_dim}")
            other = sin._batched() if isinstance(sin, RotaryPositions) and sin._rows else sin
            return self._batched().apply_one(x.unsqueeze(0), 2, interleaved, sin=other).squeeze(0)
        layout = _layout(unsqueeze_dim)
        _qk_norm.refuse_pending()
        freqs, kw = self._args(x, self._conjugate(sin))
        interleaved = self.rope.interleaved if interleaved is None else interleaved
        return _apply_one(x, freqs, 0, interleaved, layout=layout, **kw)

    def to(self, *args: Any, **kwargs: Any) -> "RotaryPositions":
        """DeepSeek-V2 moves its freqs_cis to q's device: the ids move in _args."""
        return self

    def _args(self, x: torch.Tensor, conjugate: bool = False):
        # The family's pairing (rotary.hf_families); the span starts at 0 here: the
        # patched function gets what the family rotates (MLA passes q_rot alone),
        # or ends with the head (Family.span "trailing").
        freqs, inv_freq = self._state.tables(x.device, self._held)
        pos = self.position_ids
        pos = pos if pos.device == x.device else pos.to(x.device)
        # Multimodal [3, batch, seq] ids: each pair at its axis (rope.pair_axes).
        axes = self.rope.pair_axes if pos.dim() == 3 else None
        kw = {"position_ids": pos, "inv_freq": inv_freq, "pair_axes": axes,
              "inverse": self._state.inverse != conjugate}
        if self._state.trailing:
            if x.dim() < 1 or x.shape[-1] < self.rope.dim:
                raise ValueError(f"rotary: the patched rotation turns the last {self.rope.dim} dims of each head, "
                                 f"got a tensor of shape {tuple(x.shape)}")
            kw["rotary_offset"] = x.shape[-1] - self.rope.dim
        return freqs, kw

    def __repr__(self) -> str:
        return f"RotaryPositions(position_ids={tuple(self.position_ids.shape)}, rope={self.rope.extra_repr()})"
