"""The table state of one patched rotary embedding (rotary.integrations.transformers)."""

from typing import Dict, Tuple

import torch

from ..module import RotaryEmbedding


class _RopeState:
    """One patched rotary embedding: our module and its tables per device."""

    def __init__(self, rope: RotaryEmbedding, inverse: bool = False, trailing: bool = False) -> None:
        self.rope = rope
        self.inverse = inverse  # the family rotates by the negative angle (rotary.hf_families)
        # The family's functions rotate the last rope.dim dims of whatever head
        # they get (DeepSeek-V4: the attention's and the indexer's widths).
        self.trailing = trailing
        self._cache: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs, inv_freq = self.rope.freqs, self.rope.inv_freq
        if freqs.device == device:
            return freqs, inv_freq
        hit = self._cache.get(device)
        if hit is None or hit[0] is not freqs:  # host-driven rules rebuild the table
            hit = (freqs, freqs.to(device), inv_freq.to(device))
            self._cache[device] = hit
        return hit[1], hit[2]

    def prepare(self, position_ids: torch.Tensor) -> None:
        """Host-driven rules (dynamic, longrope): rebuild the table for the
        reach of this forward pass, as dynamic_rope_update does."""
        if self.rope.host_driven and position_ids.numel() > 0:
            self.rope.update_for_reach(int(position_ids.max()) + 1)
