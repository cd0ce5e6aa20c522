"""``rotary.RotaryEmbedding``: an ``nn.Module`` over ``torch.ops.rotary``."""

from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from . import _C
from ._ops import _legacy_positions, apply_rope, apply_rope_qk

ScalingSpec = Union[None, Mapping[str, Any], "_C.RopeScaling"]
AngleDtype = Union[str, torch.dtype]

_MAX_START_POS = 2**60  # the op's bound too; the message comes from C++
_APPLY = torch.ops.rotary.apply_rope.default
_APPLY_QK = torch.ops.rotary.apply_rope_qk.default
_APPLY_KV = torch.ops.rotary.apply_rope_with_kv_cache_.default
_FP8 = torch.float8_e4m3fn
# The seq dim of each layout the ops take (head_dim is last in all of them).
_SEQ_AXIS = {"BHSD": 2, "BSHD": 1, "SBHD": 0}


# torch.compiler.disable that imports torch._dynamo at the first call: at
# import it would double `import rotary`'s time.
_eager_only = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


def _seq_axis(layout, who: str) -> int:
    ax = _SEQ_AXIS.get(layout) if type(layout) is str else None
    if ax is None:
        raise ValueError(f"{who}: layout must be 'BHSD', 'BSHD' or 'SBHD', got {layout!r}")
    return ax


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a cached complex64 table ``freqs``
    ``[max_seq_len, dim // 2]`` and its float64 frequencies ``inv_freq``
    ``[dim // 2]``, built by the same C++ code as the C++ module (so
    ``state_dict`` moves between the two).

    ``dim`` is the rotary dim (the rotated width); a head may be wider, in
    which case the op rotates its first ``dim`` dims (partial rotary).
    ``scaling`` picks the frequency rule, as a dict shaped like Hugging Face's
    ``rope_parameters`` (``{"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 4096}``; ``"type"`` is an alias of
    ``"rope_type"``): ``default``, ``linear``, ``ntk``, ``dynamic``, ``yarn``,
    ``llama3`` or ``longrope``. The C++ side parses and validates it (an
    error is a ``ValueError`` naming the field) and computes every rule; see
    docs/api.md "Frequency rules". ``RotaryEmbedding.from_hf_config(config)`` builds
    the module a transformers config describes.

    ``rope(x, start_pos=p)`` rotates one tensor; ``rope(q, k, start_pos=p)``
    rotates both in one kernel call. ``offsets=`` (``[]`` or ``[batch]``)
    shifts each sequence: token ``s`` of batch ``b`` is at ``start_pos +
    offsets[b] + s``. ``position_ids=`` (``[seq]`` or ``[batch, seq]``, any
    integer dtype) gives absolute positions as in Hugging Face; ``start_pos``
    must then be 0. (``positions=`` is deprecated: it still works for one
    release, with a ``DeprecationWarning``.) A head may be wider than ``dim``,
    never narrower (``ValueError``). ``layout=`` is how q and k are laid
    out: ``"BHSD"`` (default) ``[batch, heads, seq, head_dim]``, ``"BSHD"``
    (flash-attn) or ``"SBHD"``, read as they are (no copies); positions run
    along that layout's seq dim.
    ``rope.forward_with_cache(q, k, v, cache)`` rotates and appends to a
    :class:`rotary.KVCache` in one op, as ``CppRotaryEmbedding`` does (a
    graph break under ``torch.compile``: the cache's length is host state).
    Casting the module (``.half()``, ``.to(torch.bfloat16)``) leaves both
    buffers as they are; ``.to(device)`` moves them. Works inside
    ``torch.compile(fullgraph=True)`` for every rule except the two
    host-driven ones: ``dynamic`` and ``longrope`` rebuild the table on the
    host when a call reaches past their threshold (as transformers'
    ``dynamic_rope_update`` does), reading ``offsets`` / ``position_ids`` on the host, so they
    are neither compile- nor CUDA-graph friendly.

    ``angle_dtype="float64"`` (default) forms every angle ``pos * inv_freq`` in
    float64: entries within ~3e-8 of exact at any position, and positions past
    the table are computed exactly on the fly. ``angle_dtype="float32"``
    reproduces the tables of Hugging Face / Meta (``float(pos) *
    float(inv_freq)`` rounded to float32, then cos/sin), whose phase error
    grows with the position (README "Precision"); for parity with a model
    trained on them. Such a module has no on-the-fly path (it is float64
    only): a position past ``max_seq_len`` is an ``IndexError`` (NaN for
    device-side positions on CUDA).

    ``load_state_dict`` checks the saved ``freqs`` / ``inv_freq`` against the
    module's options and then rebuilds them from the options, so a loaded
    table is never silently different. Tables built for another theta, rule,
    ``max_seq_len`` or ``angle_dtype`` make it raise ``RuntimeError`` (as for
    any ``load_state_dict`` error), whose message names the mismatch; the
    buffers are then left as they were.

    TorchScript (``torch.jit.script``, deprecated since torch 2.11) is not
    supported: scripting a model that holds this module raises a
    ``RuntimeError`` that says so. Use ``torch.compile``, ``torch.export`` or
    AOTInductor (docs/deploy.md). ``forward`` may be
    called from several threads at once (the host-driven rules take a lock).

    Every decision about the tables (which to build, when ``dynamic`` /
    ``longrope`` rebuild them for a call's reach, load checks, the lock) is
    made by ``rotary._C.RopeTables``, the C++ type the C++ module uses too;
    this class only keeps the buffers, so that its forward stays
    compile-friendly. A call that raises leaves the module as it was.
    ``host_driven`` says whether the rule rebuilds on the host;
    ``rope_state`` is the sequence length the rule was last evaluated at (0:
    its initial state).
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
    ) -> None:
        """Build the tables for one rule.

        Args:
            dim: rotary dim, even and > 0 (heads may be wider: partial rotary).
            max_seq_len: rows of the cached table, > 0. With float64 angles,
                positions past it are still exact (computed on the fly).
            theta: frequency base; pair ``j`` turns by ``pos * theta ** (-2j / dim)``.
            interleaved: ``True`` pairs dims (0,1), (2,3), ... (Meta Llama,
                GPT-J); ``False`` pairs (j, j + dim/2) (GPT-NeoX, Hugging Face
                ``rotate_half``).
            scaling: ``None`` (plain RoPE), a dict like Hugging Face's
                ``rope_parameters`` or a :class:`rotary.RopeScaling`.
            angle_dtype: ``"float64"`` (exact angles) or ``"float32"``
                (Hugging Face / Meta fp32-angle tables).
            rotary_offset: the rotated span is dims ``[rotary_offset,
                rotary_offset + dim)`` of each head; the rest pass through
                (DeepSeek's ``[nope | rope]`` heads).
            mrope_section: multimodal RoPE, pairs per position axis summing
                to ``dim // 2`` (Qwen2-VL ``[16, 24, 24]`` for t, h, w);
                ``position_ids`` ``[n_axes, batch, seq]`` then give each
                pair its axis's position (other positions: one per token,
                which is exactly a text token's rotation).
            mrope_interleaved: Qwen3-VL's interleaved layout of the sections
                (pair ``j`` with ``j % n = a > 0`` below ``n * section[a]``
                takes axis ``a``, the rest axis 0).
            axes_dim: axial RoPE, dims per position axis summing to ``dim``
                (FLUX ``[16, 56, 56]``); axis ``a`` owns the next
                ``axes_dim[a] // 2`` pairs at its own theta from
                ``axes_theta`` (one per axis; default ``theta``).
                ``axes_shared_spectrum=True``: one spectrum of ``dim`` dealt
                out to equal axes (Pixtral 2-D). Takes ``position_ids``
                ``[n_axes, batch, seq]``.

        Raises ``ValueError`` (a bad ``max_seq_len``, ``angle_dtype``, or
        scaling field) or ``TypeError`` (a ``scaling`` of another type).
        """
        super().__init__()
        # C++ validates every argument and how they combine (TypeError /
        # ValueError naming it, the words CppRotaryEmbedding gives) and the rule.
        self._tables = _C.RopeTables(
            dim, max_seq_len, theta, interleaved, scaling, angle_dtype=angle_dtype, rotary_offset=rotary_offset,
            mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, axes_dim=axes_dim,
            axes_theta=axes_theta, axes_shared_spectrum=axes_shared_spectrum)
        # Plain copies for forward: reading them costs nothing and traces.
        t = self._tables
        self._opts = (t.dim, t.max_seq_len, t.theta, t.interleaved, t.scaling, t.angle_dtype)
        self._host_driven = t.host_driven
        self._extends = t.extends_past_table  # float64 angles: positions past the table computed exactly
        self.rotary_offset = t.rotary_offset
        self.mrope_section = t.mrope_section or None
        self.mrope_interleaved = t.mrope_interleaved
        self.axes_dim = t.axes_dim or None
        self.pair_axes = t.pair_axes or None  # the pair -> axis map (rotary/axes.h)
        freqs, inv_freq = t.build()
        self.register_buffer("freqs", freqs)
        self.register_buffer("inv_freq", inv_freq)

    dim = property(lambda self: self._opts[0], doc="The rotary dim (rotated width).")
    max_seq_len = property(lambda self: self._opts[1], doc="Rows of the cached table (more once dynamic grew).")
    theta = property(lambda self: self._opts[2], doc="The frequency base.")
    interleaved = property(lambda self: self._opts[3], doc="Pairs (0,1), (2,3), ... (else rotate_half).")
    scaling = property(lambda self: self._opts[4], doc="The rule as a dict (defaults filled in), None for plain RoPE.")
    angle_dtype = property(lambda self: self._opts[5], doc="'float64' or 'float32'.")

    @property
    def host_driven(self) -> bool:
        """True for ``dynamic`` and ``longrope``: the tables follow each call's reach, rebuilt on the host."""
        return self._host_driven

    @property
    def rope_state(self) -> int:
        """The sequence length the rule was last evaluated at (0: its initial state)."""
        return self._tables.state

    @property
    def attention_scaling(self) -> float:
        """The factor folded into every table entry (YaRN / LongRoPE; else 1)."""
        return self._tables.attention_scaling

    @classmethod
    def from_hf_config(
        cls, config, *, max_seq_len: Optional[int] = None, angle_dtype: AngleDtype = "float64"
    ) -> "RotaryEmbedding":
        """The rotary embedding a Hugging Face ``transformers`` config (or its
        plain-dict form) describes: rotary dim ``int(head_dim *
        partial_rotary_factor)``, ``rope_theta``, the rule in ``rope_parameters``
        (or legacy ``rope_scaling``), ``interleaved=False`` (``rotate_half``).
        ``max_seq_len`` defaults to ``max_position_embeddings``. Use it with
        ``rope(q, k, position_ids=position_ids)``. ``angle_dtype="float32"``
        reproduces transformers' fp32-angle cos/sin instead of exact ones."""
        from .hf import rope_kwargs_from_hf_config

        return cls(**rope_kwargs_from_hf_config(config, max_seq_len=max_seq_len), angle_dtype=angle_dtype)

    # ------------------------------------------------------------------ tables
    def _install(self, freqs: torch.Tensor, inv_freq: torch.Tensor) -> None:
        self._buffers["freqs"] = freqs
        self._buffers["inv_freq"] = inv_freq

    def update_for_reach(self, reach: int) -> None:
        """Host-driven rules: make the tables right for a call whose largest
        position is ``reach - 1`` (see docs/api.md "Frequency rules"). Other
        rules: no-op."""
        if self._host_driven:
            self._tables.run(reach, self.freqs.device, lambda fresh: fresh is not None and self._install(*fresh))

    def extra_repr(self) -> str:
        s = (
            f"dim={self.dim}, max_seq_len={self.max_seq_len}, theta={self.theta}, "
            f"interleaved={self.interleaved}"
        )
        if self.scaling is not None:
            s += f", scaling={self.scaling}"
        if self.angle_dtype != "float64":
            s += f", angle_dtype={self.angle_dtype!r}"
        if self.rotary_offset:
            s += f", rotary_offset={self.rotary_offset}"
        if self.mrope_section is not None:
            s += f", mrope_section={self.mrope_section}"
            s += ", mrope_interleaved=True" if self.mrope_interleaved else ""
        if self.axes_dim is not None:
            s += f", axes_dim={self.axes_dim}"
        return s

    # ------------------------------------------------------------ state_dict
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Never install saved tables as they are: RopeTables checks them
        # against the options, restores the host-driven state they were saved
        # in and rebuilds both buffers. A mismatch is reported like any load
        # error (load_state_dict raises RuntimeError listing it) and leaves
        # the buffers as they were.
        fkey, ikey = prefix + "freqs", prefix + "inv_freq"
        if fkey in state_dict or ikey in state_dict:
            try:
                self._tables.restore(
                    state_dict.get(fkey), state_dict.get(ikey), "RotaryEmbedding.load_state_dict",
                    self.freqs.device, self._install,
                )
            except (ValueError, TypeError) as e:
                error_msgs.append(str(e))
            state_dict = dict(state_dict)  # the caller's dict is left alone
            for key, buf in ((fkey, self.freqs), (ikey, self.inv_freq)):
                if key in state_dict:
                    state_dict[key] = buf
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) would cast the complex table to a real dtype and
        # drop the sines, and round inv_freq; take only the device from fn.
        saved = {name: self._buffers.pop(name) for name in ("freqs", "inv_freq") if name in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buf in saved.items():
                probe = fn(torch.empty(0, device=buf.device))
                self._buffers[name] = buf.to(probe.device)
        return self

    # ----------------------------------------------------------------- forward
    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling.
        raise RuntimeError(
            "rotary.RotaryEmbedding does not support TorchScript (torch.jit.script is deprecated since torch "
            "2.11). Use torch.compile, torch.export (+ AOTInductor to run from C++), or the C++ module "
            "rotary::RotaryEmbedding; see docs/deploy.md"
        )

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor] = None,
        start_pos: int = 0,
        *,
        offsets: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        layout: str = "BHSD",
    ):
        # Decode's hot path: an int start_pos and nothing else. Straight to the
        # op overloads (no wrapper, no overload lookup); inv_freq only where
        # the call reaches past the table, so short calls skip its checks.
        ax = _SEQ_AXIS.get(layout) if type(layout) is str else None
        if (
            type(start_pos) is int
            and ax is not None
            and offsets is None
            and position_ids is None
            and positions is None
            and not self._host_driven
            and self.rotary_offset == 0
            and q.dim() == 4
            and (k is None or (isinstance(k, torch.Tensor) and k.dim() != 0))
        ):
            seq, freqs = q.size(ax), self._buffers["freqs"]
            if type(seq) is int and 0 <= start_pos and start_pos + seq <= freqs.size(0) and q.size(3) >= self._opts[0]:
                if ax != 2:  # keywords parse slowly: only when not the default
                    if k is None:
                        return _APPLY(q, freqs, start_pos, self._opts[3], layout=layout)
                    return _APPLY_QK(q, k, freqs, start_pos, self._opts[3], layout=layout)
                if k is None:
                    return _APPLY(q, freqs, start_pos, self._opts[3])
                return _APPLY_QK(q, k, freqs, start_pos, self._opts[3])
        if ax is None:
            _seq_axis(layout, "RotaryEmbedding")  # raises, naming the layout given
        # The call's arguments, in one place. The common case is decided in
        # Python (it traces); anything unusual goes to the C++ parser, which
        # raises the module's errors (and routes a deprecated positions=).
        if isinstance(k, (int, torch.SymInt)) and not isinstance(k, bool):  # rope(x, start_pos)
            k, start_pos = None, k
        if isinstance(start_pos, torch.SymInt):
            pass
        elif (
            type(start_pos) is not int
            or not 0 <= start_pos < _MAX_START_POS
            or not (k is None or (isinstance(k, torch.Tensor) and k.dim() != 0))
            or not all(t is None or isinstance(t, torch.Tensor) for t in (offsets, position_ids, positions))
        ):
            q, k, start_pos, offsets, position_ids = _C.RopeTables.call_args(
                q, k, start_pos, offsets, position_ids, positions
            )
            positions = None
        if positions is not None:  # deprecated: its rank decided its meaning
            if offsets is not None or position_ids is not None:
                raise ValueError("RotaryEmbedding: positions= is deprecated; pass offsets= or position_ids= alone")
            start_pos, offsets, position_ids = _legacy_positions(positions, start_pos, False, "RotaryEmbedding")
        if q.dim() == 4:
            self._check_span(q)
        if self._host_driven:
            return self._forward_host_driven(q, k, start_pos, offsets, position_ids, layout)
        return self._rotate(q, k, start_pos, offsets, position_ids, self.freqs, self.inv_freq, layout)

    def _forward_host_driven(self, q, k, start_pos, offsets, position_ids, layout="BHSD"):
        seq_len = q.shape[_SEQ_AXIS[layout]] if q.dim() == 4 else 0  # the op reports a wrong shape
        reach = _C.RopeTables.reach_of(seq_len, start_pos, offsets, position_ids)

        def op(fresh):
            # Under the lock; new tables are installed only once the op returned.
            freqs, inv_freq = (self.freqs, self.inv_freq) if fresh is None else fresh
            out = self._rotate(q, k, start_pos, offsets, position_ids, freqs, inv_freq, layout)
            if fresh is not None:
                self._install(*fresh)
            return out

        return self._tables.run(reach, self.freqs.device, op)

    @_eager_only  # the cache's length lives in C++: one graph break (see the docstring)
    def forward_with_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: "_C.KVCache",
        start_pos: Optional[int] = None,
        *,
        layout: str = "BHSD",
    ):
        """Rotate ``q`` and ``k`` in place at ``start_pos`` (default
        ``cache.length``), write the rotated ``k`` and ``v`` into the
        :class:`rotary.KVCache` at rows ``cache.length ..`` and advance its
        length, in one ``torch.ops.rotary.apply_rope_with_kv_cache_`` call.
        Returns ``(q, keys, values)``, the last two the filled cache as
        ``[batch, kv_heads, length, head_dim]`` (``cache.keys_values(q.dtype)``:
        float8 caches dequantised). The same semantics, checks and bits as
        ``CppRotaryEmbedding.forward_with_cache``; ``layout`` is that of q, k
        and v (the cache keeps its own). A call that raises writes nothing.

        Under ``torch.compile`` the call is one graph break (the length lives
        in the C++ cache and is read and advanced on the host), so
        ``fullgraph=True`` refuses it; for one graph, call
        :func:`rotary.apply_rope_with_kv_cache_` on cache tensors you own."""
        who = "RotaryEmbedding.forward_with_cache"
        if not isinstance(cache, _C.KVCache):
            raise TypeError(f"{who}: cache must be a rotary.KVCache, got {type(cache).__name__}")
        impl = cache.cpp_module
        ax = _seq_axis(layout, who)
        # The C++ module's checks, in its order (dtypes named as torch names them).
        if start_pos is not None and (type(start_pos) is not int or not 0 <= start_pos < _MAX_START_POS):
            start_pos = _C.check_start_pos(start_pos)  # raises the module's error
        if q.dim() != 4:
            raise ValueError(f"{who}: q must be 4-D {layout} [batch, heads, seq, head_dim] in that order, got "
                             f"{list(q.shape)}")
        bufs = impl._buffers  # one lookup (cache.k goes through nn.Module.__getattr__: 4 us)
        kc, vc = bufs["k"], bufs["v"]
        if kc.dtype != k.dtype and kc.dtype != _FP8:
            raise TypeError(f"{who}: the KVCache holds {kc.dtype} but k is {k.dtype}; build the KVCache with "
                            f"dtype={k.dtype} (or torch.float8_e4m3fn), or cast k")
        seq, filled, capacity = q.size(ax), impl._length, cache.capacity
        if filled + seq > capacity:
            raise IndexError(f"{who}: appending {seq} positions to a cache holding {filled} exceeds its "
                             f"capacity {capacity}")
        advance = getattr(impl, "_advance", None)
        if advance is None:  # an older rotary._C: nothing written yet
            raise RuntimeError(f"{who} needs KVCache._advance, which this build of rotary._C lacks; rebuild it")
        pos = filled if start_pos is None else start_pos
        self._check_span(q)
        # Keywords only where not the schema's default: torch parses them slowly.
        kw = {}
        if pos != filled:  # rows go at length() .. even when the rotation is elsewhere
            batch = q.size(1 if layout == "SBHD" else 0)
            kw["cache_positions"] = torch.arange(filled, filled + seq, device=q.device).expand(batch, seq)
        if ax != 2:
            kw["layout"] = layout
        if cache.layout != "BHSD":
            kw["kv_layout"] = cache.layout
        if kc.dtype == _FP8:
            kw["k_scale"], kw["v_scale"] = bufs["k_scale"], bufs["v_scale"]
        if self.rotary_offset:
            kw["rotary_offset"] = self.rotary_offset

        def op(fresh):
            freqs, inv_freq = (self._buffers["freqs"], self._buffers["inv_freq"]) if fresh is None else fresh
            past = pos + seq > freqs.size(0)
            if past and not self._extends:  # float32 angles: no on-the-fly path
                self._tables.check_rows(seq, pos, False, freqs.size(0))
            # inv_freq only where the call may reach past the table, as in C++.
            extra = dict(kw, inv_freq=inv_freq) if past and self._extends else kw
            _APPLY_KV(q, k, v, kc, vc, freqs, pos, self._opts[3], **extra)
            if fresh is not None:
                self._install(*fresh)

        if self._host_driven:
            self._tables.run(_C.RopeTables.reach_of(seq, pos, None, None), self.freqs.device, op)
        else:
            op(None)
        advance(seq)
        keys, values = cache.keys_values(q.dtype)
        return q, keys, values

    def _check_span(self, q):
        """head_dim of a 4-D q holds the rotated span (the C++ module's words)."""
        if q.shape[-1] < self.rotary_offset + self.dim:
            need = (f"rotary_offset + dim = {self.rotary_offset + self.dim} (the rotated span)" if self.rotary_offset
                    else "dim (the rotated width)")
            raise ValueError(
                f"RotaryEmbedding(dim={self.dim}): head_dim must be >= {need}, got head_dim {q.shape[-1]} "
                f"(shape {tuple(q.shape)})"
            )

    def _rotate(self, q, k, start_pos, offsets, position_ids, freqs, inv_freq, layout="BHSD"):
        # inv_freq lets positions past the cached rows be computed exactly;
        # float32 angles have no on-the-fly path (it is float64 only).
        inv = inv_freq if self._extends else None
        given = offsets is not None or position_ids is not None
        if inv is None and not given and q.dim() == 4 and isinstance(start_pos, int):
            seq = q.shape[_SEQ_AXIS[layout]]
            if seq > 0 and start_pos + seq > freqs.shape[0]:
                self._tables.check_rows(seq, start_pos, False, freqs.shape[0])
        kw = dict(offsets=offsets, position_ids=position_ids, inv_freq=inv, rotary_offset=self.rotary_offset,
                  layout=layout)
        if self.pair_axes is not None and position_ids is not None and position_ids.dim() == 3:
            kw["pair_axes"] = self.pair_axes  # [n_axes, batch, seq]; else a text token's rotation
        if k is None:
            return apply_rope(q, freqs, start_pos, self._opts[3], **kw)
        return apply_rope_qk(q, k, freqs, start_pos, self._opts[3], **kw)
