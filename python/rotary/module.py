"""``rotary.RotaryEmbedding``: an ``nn.Module`` over ``torch.ops.rotary``."""

import threading
from contextlib import nullcontext
from typing import Any, Dict, Mapping, Optional, Union

import torch
from torch import nn

from . import _C
from ._ops import apply_rope, apply_rope_qk

ScalingSpec = Union[None, Mapping[str, Any], "_C.RopeScaling"]
AngleDtype = Union[str, torch.dtype]


def _angle_dtype_name(angle_dtype: AngleDtype) -> str:
    """"float64" or "float32" (from either spelling or torch.float64 / torch.float32)."""
    name = str(angle_dtype)
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in ("float64", "float32"):
        raise ValueError(
            "RotaryEmbedding: angle_dtype must be 'float64' (exact angles, the default) or 'float32' "
            f"(the fp32-angle tables of Hugging Face / Meta), got {angle_dtype!r}"
        )
    return name


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
    README "Frequency rules". ``RotaryEmbedding.from_hf_config(config)`` builds
    the module a transformers config describes.

    ``rope(x, start_pos=p)`` rotates one tensor; ``rope(q, k, start_pos=p)``
    rotates both in one kernel call; ``positions=`` (or its alias
    ``position_ids=``, ``[batch, seq]`` int64) gives absolute position ids.
    Casting the module (``.half()``, ``.to(torch.bfloat16)``) leaves both
    buffers as they are; ``.to(device)`` moves them. Works inside
    ``torch.compile(fullgraph=True)`` for every rule except the two
    host-driven ones: ``dynamic`` and ``longrope`` rebuild the table on the
    host when a call reaches past their threshold (as transformers'
    ``dynamic_rope_update`` does), reading ``positions`` on the host, so they
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
    module's options (``ValueError`` when they were built for another theta,
    rule, ``max_seq_len`` or ``angle_dtype``) and then rebuilds them from the
    options, so a loaded table is never silently different. ``forward`` may be
    called from several threads at once (the host-driven rules take a lock).
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
    ) -> None:
        super().__init__()
        if max_seq_len <= 0:
            raise ValueError(f"RotaryEmbedding: max_seq_len must be > 0, got {max_seq_len}")
        self.angle_dtype = _angle_dtype_name(angle_dtype)
        self.dim = dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.interleaved = interleaved
        if isinstance(scaling, _C.RopeScaling):
            spec = scaling.to_dict()
        elif scaling is None:
            spec = {"rope_type": "default"}
        elif isinstance(scaling, Mapping):
            spec = _C.RopeScaling.from_dict(dict(scaling)).to_dict()
        else:
            raise TypeError(
                "RotaryEmbedding: scaling must be None, a dict like Hugging Face's rope_parameters, "
                f"or a rotary._C.RopeScaling; got {scaling!r}"
            )
        if spec["rope_type"] == "dynamic":
            # The same default as the C++ module: the base grows past max_seq_len.
            spec.setdefault("max_position_embeddings", max_seq_len)
        # The rule as a plain dict (None for plain RoPE): picklable, printable,
        # and what is handed back to C++ whenever the table is built.
        self.scaling: Optional[Dict[str, Any]] = None if spec["rope_type"] == "default" else spec
        self.attention_scaling = 1.0
        # State of the host-driven rules (as in the C++ module).
        self._host_driven = _C.depends_on_seq_len(spec)
        self._dynamic_len = 0  # dynamic: length the table was grown for; 0 = not grown
        self._long_factors = False  # longrope: long_factor in use
        # Serialises forward of the host-driven rules (they rebuild the tables).
        self._lock = threading.RLock() if self._host_driven else None
        self._build_tables()

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
    def _build_tables(self) -> None:
        seq_len, rows = 0, self.max_seq_len
        rope_type = self.scaling["rope_type"] if self.scaling else "default"
        if rope_type == "dynamic" and self._dynamic_len > 0:
            seq_len = self._dynamic_len
            rows = max(rows, seq_len)
        elif rope_type == "longrope" and self._long_factors:
            seq_len = self.scaling["original_max_position_embeddings"] + 1
        freqs, inv_freq, self.attention_scaling = _C.rope_tables(
            self.dim, self.theta, self.scaling, seq_len, rows, self.angle_dtype
        )
        old = self._buffers.get("freqs")
        if old is not None:
            freqs, inv_freq = freqs.to(old.device), inv_freq.to(old.device)
        self.register_buffer("freqs", freqs)
        self.register_buffer("inv_freq", inv_freq)

    def update_for_reach(self, reach: int) -> None:
        """Host-driven rules: make the tables right for a call whose largest
        position is ``reach - 1``. ``dynamic`` grows past the length it was
        last built for and returns to its original frequencies below
        ``max_position_embeddings``; ``longrope`` uses ``long_factor`` while
        ``reach > original_max_position_embeddings``. Other rules: no-op."""
        if not self._host_driven:
            return
        if self.scaling["rope_type"] == "dynamic":
            original = self.scaling["max_position_embeddings"]
            cached = self._dynamic_len if self._dynamic_len > 0 else original
            if reach > cached:
                self._dynamic_len = reach
                self._build_tables()
            elif reach < original and cached > original:
                self._dynamic_len = 0
                self._build_tables()
        else:  # longrope
            want_long = reach > self.scaling["original_max_position_embeddings"]
            if want_long != self._long_factors:
                self._long_factors = want_long
                self._build_tables()

    def extra_repr(self) -> str:
        s = (
            f"dim={self.dim}, max_seq_len={self.max_seq_len}, theta={self.theta}, "
            f"interleaved={self.interleaved}"
        )
        if self.scaling is not None:
            s += f", scaling={self.scaling}"
        if self.angle_dtype != "float64":
            s += f", angle_dtype={self.angle_dtype!r}"
        return s

    # ------------------------------------------------------------ state_dict
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Never install saved tables as they are: check them against the
        # options, restore the host-driven state they were saved in, and
        # rebuild both buffers from the options. A mismatch is reported like
        # any load error (load_state_dict raises RuntimeError listing it) and
        # leaves the buffers as they were.
        fkey, ikey = prefix + "freqs", prefix + "inv_freq"
        if fkey in state_dict or ikey in state_dict:
            try:
                seq_len = _C.check_saved_tables(
                    self.dim, self.max_seq_len, self.theta, self.scaling, self.angle_dtype,
                    state_dict.get(fkey), state_dict.get(ikey), "RotaryEmbedding.load_state_dict",
                )
            except ValueError as e:
                error_msgs.append(str(e))
            else:
                with self._locked():
                    rope_type = self.scaling["rope_type"] if self.scaling else "default"
                    if rope_type == "dynamic":
                        self._dynamic_len = seq_len if seq_len > self.scaling["max_position_embeddings"] else 0
                    elif rope_type == "longrope":
                        self._long_factors = seq_len > self.scaling["original_max_position_embeddings"]
                    self._build_tables()
            state_dict = dict(state_dict)  # the caller's dict is left alone
            for key, buf in ((fkey, self.freqs), (ikey, self.inv_freq)):
                if key in state_dict:
                    state_dict[key] = buf
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    # A lock is neither picklable nor deep-copyable: a copy gets a fresh one.
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.__dict__.get("_host_driven"):
            self._lock = threading.RLock()

    def _locked(self):
        return self._lock if self._lock is not None else nullcontext()

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
    @staticmethod
    def _check_start_pos(start_pos: int) -> None:
        if isinstance(start_pos, int):
            if start_pos < 0:
                raise ValueError(f"RotaryEmbedding: start_pos must be >= 0, got {start_pos}")
            if start_pos >= 2**60:
                raise IndexError(f"RotaryEmbedding: start_pos must be < 2^60, got {start_pos}")

    def _update_host_driven(self, q: torch.Tensor, start_pos: int, positions: Optional[torch.Tensor]) -> None:
        seq_len = q.shape[2]
        if seq_len == 0:
            return
        reach = start_pos + seq_len
        if positions is not None and positions.numel() > 0:
            top = int(positions.max())
            reach = start_pos + top + (1 if positions.dim() == 2 else seq_len)
        self.update_for_reach(reach)

    def forward(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor] = None,
        start_pos: int = 0,
        *,
        positions: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ):
        if position_ids is not None:
            if positions is not None:
                raise ValueError("RotaryEmbedding: pass positions or position_ids (an alias), not both")
            positions = position_ids
        if isinstance(k, (int, torch.SymInt)):  # rope(x, start_pos)
            k, start_pos = None, k
        self._check_start_pos(start_pos)
        if self._host_driven:
            with self._lock:  # the table this call uses is the one built for its reach
                if q.dim() == 4:
                    self._update_host_driven(q, start_pos, positions)
                return self._rotate(q, k, start_pos, positions)
        return self._rotate(q, k, start_pos, positions)

    def _rotate(self, q, k, start_pos, positions):
        # inv_freq lets positions past the cached rows be computed exactly;
        # float32 angles have no on-the-fly path (it is float64 only).
        inv = self.inv_freq if self.angle_dtype == "float64" else None
        if inv is None and positions is None and q.dim() == 4 and isinstance(start_pos, int):
            seq_len, rows = q.shape[2], self.freqs.shape[0]
            if seq_len > 0 and start_pos + seq_len > rows:
                raise IndexError(
                    f"RotaryEmbedding(angle_dtype=float32): start_pos + seq_len = {start_pos} + {seq_len} = "
                    f"{start_pos + seq_len} exceeds max_seq_len {rows}; float32-angle tables are not extended "
                    "on the fly (that path is float64): build the module with a larger max_seq_len"
                )
        if k is None:
            return apply_rope(q, self.freqs, start_pos, self.interleaved, positions=positions, inv_freq=inv)
        return apply_rope_qk(q, k, self.freqs, start_pos, self.interleaved, positions=positions, inv_freq=inv)
