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
    use (arithmetic other than ``-sin``, indexing other than ``[..., :n]``
    keeping every rotated dim) raises."""

    __slots__ = ("position_ids", "_state", "_negated")

    def __init__(self, position_ids: torch.Tensor, state: _RopeState, negated: bool = False) -> None:
        self.position_ids = position_ids
        self._state = state
        self._negated = negated

    def __neg__(self) -> "RotaryPositions":
        # (cos, -sin) is the inverse rotation: DeepSeek-V4 turns its attention
        # output back with it (its k is its v).
        return RotaryPositions(self.position_ids, self._state, not self._negated)

    def _conjugate(self, sin: Any) -> bool:
        """Whether (self, sin), as a patched function got them for (cos, sin),
        is the inverse rotation: (h, -h). Any other pair raises."""
        paired = (sin is None or (isinstance(sin, RotaryPositions) and sin._state is self._state
                                  and sin.position_ids is self.position_ids))
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
        raise TypeError(f"rotary: the patched rotary embedding's (cos, sin) cannot be indexed by {index!r} "
                        f"(only [..., :n] with n >= its rotary dim {self.rope.dim})")

    def apply(self, q: torch.Tensor, k: torch.Tensor, unsqueeze_dim: int = 1,
              interleaved: Optional[bool] = None, sin: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k (``[batch, heads, seq, head_dim]``, or ``[batch, seq,
        heads, head_dim]`` for ``unsqueeze_dim=2``) with our kernel; interleaved:
        the calling function's pairing where it is not the rope's; sin: the
        handle the function got as sin (``-sin``: the inverse rotation)."""
        layout = _layout(unsqueeze_dim)
        freqs, kw = self._args(q, self._conjugate(sin))
        interleaved = self.rope.interleaved if interleaved is None else interleaved
        fused = _qk_norm.take(q, k)  # the q/k norms deferred to here (fuse_qk_norm)
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
        freqs, inv_freq = self._state.tables(x.device)
        pos = self.position_ids if self.position_ids.device == x.device else self.position_ids.to(x.device)
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
