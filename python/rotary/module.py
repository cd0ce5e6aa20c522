"""``rotary.RotaryEmbedding``: an ``nn.Module`` over ``torch.ops.rotary``."""

from typing import Any, Mapping, Optional, Sequence, Union

import torch

from . import _C
from ._dtensor_shards import whole_positions as _whole_positions
from ._module_state import TableBuffers, layout_of
from ._arg_checks import _index_arg
from ._cpp_wrappers import _exporting_here, refuse_fx
from ._ops import _route, apply_rope, apply_rope_qk

ScalingSpec = Union[None, Mapping[str, Any], "_C.RopeScaling"]
AngleDtype = Union[str, torch.dtype]

_MAX_START_POS = _C.MAX_POSITION  # rotary/bounds.h; the message comes from C++
_APPLY = torch.ops.rotary.apply_rope.default
_APPLY_QK = torch.ops.rotary.apply_rope_qk.default
_SEQ_AXIS = _C.SEQ_AXIS  # the seq dim of each 4-D layout (params/layouts.h)

# torch.compiler.disable, importing torch._dynamo at the first call (not at import).
_eager_only = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
_IN_CPP = ("rotary.RotaryEmbedding checks this call's arguments in C++, which Dynamo cannot trace: eagerly, at a "
           "graph break. Run the call without torch.compile (or without fullgraph=True) to see the error")
_HOST_DRIVEN = ("rotary.RotaryEmbedding with a dynamic or longrope rule rebuilds its tables on the host from each "
                "call's reach, which Dynamo cannot trace: eagerly, at a graph break. Under fullgraph=True, call "
                "update_for_reach(reach) before the compiled function and pass rope.freqs and rope.inv_freq to "
                "rotary.apply_rope_qk, or use a rule that is not host-driven (docs/api.md)")


def _copy(values):
    return None if values is None else list(values)


def _in_cpp(check, *args):
    """A C++ check that raises the module's error. Traced, a graph break runs
    it eagerly; under fullgraph=True the break names why (Dynamo's own words
    for a pybind call say only that it cannot trace one)."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=_IN_CPP)
        return _run_eagerly(check, *args)  # resumed: a skipped call, without Dynamo's pybind warning
    return check(*args)


@_eager_only
def _run_eagerly(check, *args):
    return check(*args)


class RotaryEmbedding(TableBuffers):
    """Rotary position embedding over ``torch.ops.rotary``: a complex64 table
    ``freqs`` ``[max_seq_len, dim // 2]`` and its float64 frequencies
    ``inv_freq`` ``[dim // 2]``, built, checked on load and rebuilt for
    host-driven rules by ``rotary._C.RopeTables``, the C++ module's state
    machine and shell (so ``state_dict`` moves between the two). This class
    keeps the buffers and a forward that ``torch.compile`` traces.

    ``rope(x, start_pos=p)`` or ``rope(q, k, start_pos=p, offsets=...,
    position_ids=..., layout="BHSD")``; ``rope.forward_with_cache(q, k, v,
    cache)`` rotates and appends to a :class:`rotary.KVCache` in one op. The
    options, positions, layouts, rules and errors: docs/api.md "The Python
    module". A call that raises leaves the module as it was.
    """

    def __init__(
        self,
        dim: int,
        max_seq_len: int = 4096,
        theta: float = 10000.0,
        interleaved: bool = True,
        scaling: ScalingSpec = None,
        *,
        angle_dtype: AngleDtype = "float64",
        rotary_offset: int = 0,
        mrope_section: Optional[Sequence[int]] = None,
        mrope_interleaved: bool = False,
        axes_dim: Optional[Sequence[int]] = None,
        axes_theta: Optional[Sequence[float]] = None,
        axes_shared_spectrum: bool = False,
        pair_axes: Optional[Sequence[int]] = None,
    ) -> None:
        """``dim``: the rotated width (even; heads may be wider). ``max_seq_len``:
        cached rows (float64 angles compute positions past them exactly).
        ``interleaved``: pairs (0,1), (2,3), ... (Meta, GPT-J) or, ``False``,
        (j, j + dim/2) (GPT-NeoX, HF ``rotate_half``). ``scaling``: ``None``,
        an HF ``rope_parameters``-like dict or a :class:`rotary.RopeScaling`.
        The rest: docs/api.md. ``ValueError`` / ``TypeError`` name the field."""
        super().__init__()  # C++ validates every argument, how they combine, and the rule
        self._tables = _C.RopeTables(
            dim, max_seq_len, theta, interleaved, scaling, angle_dtype=angle_dtype, rotary_offset=rotary_offset,
            mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, axes_dim=axes_dim,
            axes_theta=axes_theta, axes_shared_spectrum=axes_shared_spectrum, pair_axes=pair_axes)
        # Plain copies for forward: reading them costs nothing and traces.
        t = self._tables
        self._opts = (t.dim, t.max_seq_len, t.theta, t.interleaved, t.scaling, t.angle_dtype)
        self._host_driven = t.host_driven
        self._extends = t.extends_past_table  # float64 angles: positions past the table computed exactly
        self._layout = layout_of(t)
        freqs, inv_freq = t.build()
        device = torch.get_default_device()  # `with torch.device("meta"):`, as nn.Module's own buffers follow it
        if device.type != "cpu":
            freqs, inv_freq = freqs.to(device), inv_freq.to(device)
        self.register_buffer("freqs", freqs)
        self.register_buffer("inv_freq", inv_freq)
        t.own((self.freqs, self.inv_freq))  # a write of either before the first call shows as one

    dim = property(lambda self: self._opts[0], doc="The rotary dim (rotated width).")
    max_seq_len = property(lambda self: self._opts[1], doc="The max_seq_len built with: the table's rows until a "
                           "dynamic or longrope rule switches tables (then see freqs).")
    theta = property(lambda self: self._opts[2], doc="The frequency base.")
    interleaved = property(lambda self: self._opts[3], doc="Pairs (0,1), (2,3), ... (else rotate_half).")
    scaling = property(lambda self: self._opts[4], doc="The rule as a dict of the fields that differ from their defaults, None "
                       "for plain RoPE (RotaryEmbedding(..., scaling=it) builds the same rule).")
    angle_dtype = property(lambda self: self._opts[5], doc="'float64' or 'float32'.")
    # Read-only like the options above (an assignment was taken by some paths and not others); lists are copies.
    rotary_offset = property(lambda self: self._layout[0], doc="The first rotated dim of each head.")
    axes_dim = property(lambda self: _copy(self._layout[1]), doc="Pairs per axis of an axial rule, else None.")
    pair_axes = property(lambda self: _copy(self._layout[2]),
                         doc="The axis of each pair (M-RoPE, axial, pair_axes=), else None.")
    mrope_section = property(lambda self: self._tables.mrope_section, doc="M-RoPE's sections, else None.")
    mrope_interleaved = property(lambda self: self._tables.mrope_interleaved,
                                 doc="M-RoPE's sections interleaved (Qwen3-VL) rather than contiguous.")
    host_driven = property(lambda self: self._host_driven,
                           doc="True for dynamic and longrope: the tables follow each call's reach, on the host.")
    rope_state = property(lambda self: self._tables.state_of(self._held),
                          doc="The sequence length the rule was evaluated at for the tables held (0: its "
                              "initial state).")
    attention_scaling = property(lambda self: (self._tables.state_of(self._held),
                                               self._tables.attention_scaling)[1],
                                 doc="The factor folded into every table entry (YaRN / LongRoPE; else 1).")

    @classmethod
    def from_hf_config(cls, config, *, max_seq_len: Optional[int] = None, angle_dtype: AngleDtype = "float64",
                       layer_type: Optional[str] = None, layer_theta: Optional[float] = None,
                       allow_unverified: bool = False):
        """The module a transformers config (or its dict form) describes, for
        ``layer_type`` when its rule differs per layer type (``rotary.hf.layer_types_of``),
        ``layer_theta`` when its layers have their own bases (``rotary.hf.layer_thetas_of``);
        one it cannot serve is refused by name (docs/scaling.md), and a model
        type nothing verifies unless ``allow_unverified`` (docs/transformers.md)."""
        from .hf import rope_kwargs_from_hf_config

        kwargs = rope_kwargs_from_hf_config(config, max_seq_len, layer_type, layer_theta,
                                            allow_unverified=allow_unverified)
        return cls(**kwargs, angle_dtype=angle_dtype)

    def update_for_reach(self, reach: int) -> None:
        """Host-driven rules: make the tables right for a call whose largest
        position is ``reach - 1``. Other rules: no-op."""
        reach = _index_arg("RotaryEmbedding.update_for_reach", "reach", reach)  # torch.max(ids) + 1 too
        self._tables.check_reach(reach)
        if self._host_driven:
            self._tables.run(reach, self.freqs.device, self._held,
                             lambda fresh: fresh is not None and self._install(*fresh))

    def extra_repr(self) -> str:
        return self._tables.extra_repr()

    def __prepare_scriptable__(self):  # torch.jit.script calls it on every submodule
        raise RuntimeError(
            "rotary.RotaryEmbedding does not support TorchScript (torch.jit.script is deprecated since torch "
            "2.11). Use torch.compile, torch.export (+ AOTInductor to run from C++), or the C++ module "
            "rotary::RotaryEmbedding; see docs/deploy.md")

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, start_pos: int = 0, *,
                offsets: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, layout: str = "BHSD"):
        # rope(x, start_pos); with start_pos= as well, the C++ parser refuses the pair.
        if isinstance(k, (int, torch.SymInt)) and not isinstance(k, bool) and type(start_pos) is int and start_pos == 0:
            k, start_pos = None, k
        # Decode's hot path: an int start_pos and nothing else, straight to the
        # op overloads (a host-driven rule's under its state machine, with
        # inv_freq). Eager only: traced, its table-length test would become a
        # guard (strict export would bound seq_len and start_pos by max_seq_len).
        ax = _SEQ_AXIS.get(layout) if type(layout) is str else None
        if (type(start_pos) is int and ax is not None and offsets is None and position_ids is None
                and not torch.compiler.is_compiling()
                and positions is None and self._layout[0] == 0 and self._layout[1] is None
                and isinstance(q, torch.Tensor) and q.dim() == 4 and not q.is_nested
                and (k is None or (isinstance(k, torch.Tensor) and k.dim() != 0))
                and not self._buffers["inv_freq"].requires_grad):  # else _rotate passes it: the op refuses it
            seq, freqs, inter = q.size(ax), self._buffers["freqs"], self._opts[3]
            if type(seq) is int and 0 <= start_pos < _MAX_START_POS and q.size(3) >= self.dim:
                kw = {} if ax == 2 else {"layout": layout}  # keywords parse slowly: only when not the default
                if not self._host_driven and start_pos + seq <= freqs.size(0):
                    return _APPLY(q, freqs, start_pos, inter, **kw) if k is None else _APPLY_QK(
                        q, k, freqs, start_pos, inter, **kw)
                if self._host_driven and self._extends and seq > 0:
                    return self._host_step(start_pos + seq, freqs.device, lambda f, inv: _APPLY(
                        q, f, start_pos, inter, inv_freq=inv, **kw) if k is None else _APPLY_QK(
                        q, k, f, start_pos, inter, inv_freq=inv, **kw))
        if ax is None:
            if not isinstance(layout, str):
                raise TypeError(f"RotaryEmbedding: layout must be a str, got {layout!r}")
            plain = str.__str__(layout)  # a str subclass (a StrEnum) by the str it holds, as C++ reads it
            ax = _SEQ_AXIS.get(plain)
            if ax is None:
                raise ValueError(f"RotaryEmbedding: layout must be 'BHSD', 'BSHD' or 'SBHD', got {layout!r}")
            layout = plain
        # The common case is decided here (it traces); anything unusual goes
        # to the C++ parser, which raises the module's errors.
        if not isinstance(q, torch.Tensor) or q.is_nested or (not isinstance(start_pos, torch.SymInt) and (
                type(start_pos) is not int or not 0 <= start_pos < _MAX_START_POS
                or not (k is None or (isinstance(k, torch.Tensor) and k.dim() != 0))
                or not all(t is None or isinstance(t, torch.Tensor) for t in (offsets, position_ids, positions)))):
            # positions only to be type checked: a tensor is routed below, in Python.
            refuse_fx("RotaryEmbedding", q)
            q, k, start_pos, offsets, position_ids = _in_cpp(
                _C.RopeTables.call_args, q, k, start_pos, offsets, position_ids,
                None if isinstance(positions, torch.Tensor) else positions)
        if positions is not None:  # deprecated: its rank decided its meaning
            start_pos, offsets, position_ids = _route(positions, offsets, position_ids, start_pos, None,
                                                      "RotaryEmbedding")
        if q.dim() == 4 and q.shape[-1] < self._layout[0] + self.dim:
            _in_cpp(self._tables.check_span, q)  # raises, in the C++ module's words
        if not self._host_driven:
            return self._rotate(q, k, start_pos, offsets, position_ids, self.freqs, self.inv_freq, layout)
        seq_len = q.shape[ax] if q.dim() == 4 else 0  # the op reports a wrong shape
        exporting = _exporting_here()
        if exporting and (not isinstance(seq_len, int) or not isinstance(start_pos, int)
                          or offsets is not None or position_ids is not None):
            raise ValueError(
                f"RotaryEmbedding({self._tables.extra_repr()}): its rule rebuilds the tables on the host from each "
                "call's positions, which torch.export cannot trace with a symbolic sequence length or position "
                "tensors; export it with static shapes and an int start_pos (the tables it reaches are baked in), "
                "or use a rule without a host-driven state (docs/deploy.md)")
        # Under torch.compile the host step runs at a graph break, eagerly (one
        # frame, no recompiles of its own): it records. An export bakes the
        # tables it reaches in and leaves the module as it was (it puts the
        # traced buffers back; a new state would outlive them).
        if torch.compiler.is_dynamo_compiling():
            torch._dynamo.graph_break(msg=_HOST_DRIVEN)
            return _run_eagerly(self._host_call, q, k, start_pos, offsets, position_ids, seq_len, layout, True)
        return self._host_call(q, k, start_pos, offsets, position_ids, seq_len, layout, not exporting)

    def _host_call(self, q, k, start_pos, offsets, position_ids, seq_len, layout, record):
        # Every rank sizes the table by every rank's positions.
        offsets, position_ids = _whole_positions(offsets, "offsets"), _whole_positions(position_ids)
        reach = _C.RopeTables.reach_of(seq_len, start_pos, offsets, position_ids)
        return self._host_step(reach, self.freqs.device, lambda f, inv: self._rotate(
            q, k, start_pos, offsets, position_ids, f, inv, layout), record=record)

    def _host_step(self, reach: int, device: torch.device, rotate, record: bool = True):
        """rotate(freqs, inv_freq) with the tables a call reaching ``reach``
        needs, under the state machine's lock; new tables are installed once
        it returned, and neither installed nor recorded when not ``record``.
        The buffers are read from _buffers: Module.__getattr__ costs ~2 us."""
        def op(fresh):
            out = rotate(*(self._held() if fresh is None else fresh))
            if fresh is not None and record:
                self._install(*fresh)
            return out

        return self._tables.run(reach, device, self._held, op, record=record)

    @_eager_only  # the cache's length lives in C++: one graph break (docs/api.md)
    def forward_with_cache(self, q, k, v, cache: "_C.KVCache", start_pos: Optional[int] = None, *,
                           layout: str = "BHSD"):
        """Rotate ``q`` and ``k`` in place at ``start_pos`` (default
        ``cache.length``), write the rotated ``k`` and ``v`` into ``cache``
        and advance its length, in one fused op; returns ``(q, keys,
        values)``. The C++ module's shell runs it (the same checks and bits);
        a call that raises writes nothing."""
        return self._tables.forward_with_cache(q, k, v, cache, start_pos, layout, self._held, self._install)

    def _rotate(self, q, k, start_pos, offsets, position_ids, freqs, inv_freq, layout):
        # inv_freq lets positions past the cached rows be computed exactly;
        # float32 angles have no on-the-fly path (it is float64 only).
        # One that requires grad goes to the op, which refuses it (it would get no gradient).
        inv = inv_freq if self._extends or inv_freq.requires_grad else None
        if (inv is None and offsets is None and position_ids is None and q.dim() == 4 and isinstance(start_pos, int)
                and not torch.compiler.is_compiling()):  # traced, the op refuses the rows in its words
            seq = q.shape[_SEQ_AXIS[layout]]
            if seq > 0 and start_pos + seq > freqs.shape[0]:
                self._tables.check_rows(seq, start_pos, False, freqs.shape[0])
        offset, axes_dim, pair_axes = self._layout
        kw = dict(offsets=offsets, position_ids=position_ids, inv_freq=inv, rotary_offset=offset, layout=layout)
        if pair_axes is not None and position_ids is not None and position_ids.dim() == 3:
            kw["pair_axes"] = pair_axes  # [n_axes, batch, seq]; else a text token's rotation
        elif axes_dim is not None:  # axial: no 1-D meaning (rotary::module_pair_axes)
            _in_cpp(self._tables.refuse_axial_call, "no position_ids" if position_ids is None
                    else f"position_ids of shape {list(position_ids.shape)}")
        elif position_ids is not None and position_ids.dim() == 3:  # N-D ids, no map (rotary::module_pair_axes)
            _in_cpp(self._tables.refuse_nd_positions, str(list(position_ids.shape)))
        if k is None:
            return apply_rope(q, freqs, start_pos, self._opts[3], **kw)
        return apply_rope_qk(q, k, freqs, start_pos, self._opts[3], **kw)
