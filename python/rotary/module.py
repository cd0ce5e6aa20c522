"""``rotary.RotaryEmbedding``: an ``nn.Module`` over ``torch.ops.rotary``."""

from typing import Optional

import torch
from torch import nn

from ._ops import apply_rope, apply_rope_qk, rope_freqs


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cached complex64 table ``freqs``
    ``[max_seq_len, dim // 2]``, built by the same C++ code as the C++ module
    (so ``state_dict`` moves between the two).

    ``rope(x, start_pos=p)`` rotates one tensor; ``rope(q, k, start_pos=p)``
    rotates both in one kernel call. Casting the module (``.half()``,
    ``.to(torch.bfloat16)``) leaves the table complex64; ``.to(device)`` moves it.
    Works inside ``torch.compile(fullgraph=True)``.
    """

    def __init__(
        self,
        dim: int,
        max_seq_len: int = 4096,
        theta: float = 10000.0,
        interleaved: bool = True,
    ) -> None:
        super().__init__()
        if max_seq_len <= 0:
            raise ValueError(f"RotaryEmbedding: max_seq_len must be > 0, got {max_seq_len}")
        self.dim = dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.interleaved = interleaved
        self.register_buffer("freqs", rope_freqs(dim, max_seq_len, theta))

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, max_seq_len={self.max_seq_len}, theta={self.theta}, "
            f"interleaved={self.interleaved}"
        )

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) would cast the complex table to a real dtype and
        # drop the sines; take only the device from fn.
        freqs = self._buffers.pop("freqs")
        try:
            super()._apply(fn, recurse)
        finally:
            probe = fn(torch.empty(0, device=freqs.device))
            self._buffers["freqs"] = freqs.to(probe.device)
        return self

    def _check_range(self, start_pos: int, seq_len: int) -> None:
        if isinstance(start_pos, int):
            if start_pos < 0:
                raise ValueError(f"RotaryEmbedding: start_pos must be >= 0, got {start_pos}")
            if start_pos + seq_len > self.max_seq_len:
                raise IndexError(
                    f"RotaryEmbedding: start_pos + seq_len = {start_pos} + {seq_len} = "
                    f"{start_pos + seq_len} exceeds max_seq_len {self.max_seq_len}; "
                    "construct the module with a larger max_seq_len"
                )

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor] = None,
        start_pos: int = 0,
        *,
        positions: Optional[torch.Tensor] = None,
    ):
        if q.dim() == 4 and positions is None:
            self._check_range(start_pos, q.shape[2])
        if k is None:
            return apply_rope(q, self.freqs, start_pos, self.interleaved, positions=positions)
        return apply_rope_qk(q, k, self.freqs, start_pos, self.interleaved, positions=positions)
