"""The table state of one patched rotary embedding (rotary.integrations.transformers)."""

from typing import Dict, Optional, Tuple

import torch

from .. import _C
from .._cpp_wrappers import _exporting_here
from ..module import RotaryEmbedding, _run_eagerly


_HOST_DRIVEN = ("rotary: the patched model's dynamic or longrope rule reads max(position_ids) on the host once per "
                "forward pass and rebuilds its tables past the rule's threshold, as transformers' dynamic_rope_update "
                "does; Dynamo cannot trace that, so it runs eagerly at a graph break (compile without "
                "fullgraph=True; torch.export cannot take it), or use a rule that is not host-driven "
                "(docs/transformers.md, Limits)")

_HOST_TRACED = ("rotary: the patched model's dynamic or longrope rule reads max(position_ids) on the host once per "
                "forward pass to choose its tables, which torch.jit.trace and torch.export would keep as the traced "
                "call's; run it eagerly or under torch.compile (one graph break), or use a rule that is not "
                "host-driven (docs/transformers.md, Limits)")

_META_BUILD = ("rotary: this model was patched on the meta device, so its rotary table is built on the first forward "
               "pass; the build runs in C++, which Dynamo cannot trace, so it runs eagerly at a graph break. For one "
               "graph (fullgraph=True), run one eager forward pass first, or patch after the weights are loaded "
               "(docs/transformers.md, Limits)")


class _RopeState:
    """One patched rotary embedding: our module and its tables per device."""

    def __init__(self, rope: RotaryEmbedding, inverse: bool = False, trailing: bool = False) -> None:
        self.rope = rope
        self.inverse = inverse  # the family rotates by the negative angle (rotary.hf_families)
        # The family's functions rotate the last rope.dim dims of whatever head
        # they get (DeepSeek-V4: the attention's and the indexer's widths).
        self.trailing = trailing
        self._cache: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _leave_meta(self, device: torch.device) -> None:
        # Patched on a meta-initialised model: our module sits outside the
        # module tree (to_empty never reaches it); built from its options on
        # first use, in the state the rule is in.
        if self.rope.freqs.is_meta and device.type != "meta":
            if torch.compiler.is_dynamo_compiling():  # the build is C++: named, where Dynamo names a pybind call
                torch._dynamo.graph_break(msg=_META_BUILD)
                _run_eagerly(lambda: self.rope.to_empty(device=device))
                return
            self.rope.to_empty(device=device)

    def held(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The tables a host-driven rule holds now, for a handle to keep: a
        later forward may rebuild them (longrope's factors, a dynamic reset)
        before gradient checkpointing recomputes this one. None where they
        never change."""
        host = self.rope.host_driven and not self.rope.freqs.is_meta  # meta: built on first use
        return (self.rope.freqs, self.rope.inv_freq) if host else None

    def tables(self, device: torch.device,
               held: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        self._leave_meta(device)
        freqs, inv_freq = held if held is not None else (self.rope.freqs, self.rope.inv_freq)
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
            if torch.compiler.is_dynamo_compiling():  # named, where Dynamo would name a skipped pybind function
                torch._dynamo.graph_break(msg=_HOST_DRIVEN)
                return _run_eagerly(self._prepare, position_ids)  # resumed: without Dynamo's pybind warning
            self._prepare(position_ids)

    def _prepare(self, position_ids: torch.Tensor) -> None:
        if torch.jit.is_tracing() or _exporting_here():  # max(position_ids) would be one constant
            raise RuntimeError(_HOST_TRACED)
        self._leave_meta(position_ids.device)
        # 0 (the tables as held) for ids the op refuses: its error, not update_for_reach's.
        self.rope.update_for_reach(_C.RopeTables.reach_of(position_ids.shape[-1], 0, None, position_ids))


def _dynamic_rules(emb, states):
    """(buffer prefix, layer type, state) of each rule whose transformers
    module keeps a dynamic-NTK state (max_seq_len_cached and a grown inv_freq)."""
    if not hasattr(emb, "original_max_seq_len"):
        return
    kinds = getattr(emb, "rope_type", None)  # a name, or one per layer type
    for layer_type, state in states.items():
        kind = kinds.get(layer_type) if isinstance(kinds, dict) else kinds if layer_type is None else None
        if isinstance(kind, str) and "dynamic" in kind and state.rope.host_driven:
            yield ("" if layer_type is None else f"{layer_type}_"), layer_type, state


def take_dynamic_state(emb, states) -> None:
    """At patch: a dynamic rule starts from the length transformers' module
    grew to (it stays grown until a call shorter than the original length)."""
    for prefix, _, state in _dynamic_rules(emb, states):
        grown = int(getattr(emb, f"{prefix}max_seq_len_cached", emb.max_seq_len_cached))
        if grown > emb.original_max_seq_len:
            state.rope.update_for_reach(grown)


def give_dynamic_state(emb, states) -> None:
    """At unpatch: transformers' module takes the length the patched rule
    grew to (or its reset), with its own frequencies for that length."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for prefix, layer_type, state in _dynamic_rules(emb, states):
        reach, current = state.rope.rope_state, getattr(emb, f"{prefix}inv_freq")
        kw = {} if layer_type is None else {"layer_type": layer_type}
        if reach > emb.original_max_seq_len:
            kind = emb.rope_type if layer_type is None else emb.rope_type[layer_type]
            # As transformers' own update: seq_len a tensor (max(position_ids) + 1); an int rounds
            # the base one float32 ulp apart.
            reach = torch.tensor(reach, device=current.device)
            inv_freq, emb.attention_scaling = ROPE_INIT_FUNCTIONS[kind](emb.config, current.device, seq_len=reach, **kw)
        else:
            inv_freq, reach = getattr(emb, f"{prefix}original_inv_freq").to(current.device), emb.original_max_seq_len
        emb.register_buffer(f"{prefix}inv_freq", inv_freq, persistent=False)
        setattr(emb, f"{prefix}max_seq_len_cached", reach)
