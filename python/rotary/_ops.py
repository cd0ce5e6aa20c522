"""Typed wrappers over ``torch.ops.rotary``. They add no logic: every check
and every kernel lives in C++ behind the dispatcher."""

import warnings
from typing import Any, Mapping, Optional, Sequence, Tuple

import torch

from . import _C
from ._arg_checks import (_bool_arg, _float_arg, _index_arg, _int_arg, _pair_axes, _real_arg,  # noqa: F401
                          _required_tensor, _start_pos, _str_arg, _table_args, _tensor_arg)


def freqs_table(
    dim: int,
    max_seq_len: int,
    theta: float = 10000.0,
    scaling: Optional[Mapping[str, Any]] = None,
    seq_len: int = 0,
    *,
    angle_dtype: Any = "float64",
) -> torch.Tensor:
    """complex64 table ``[max_seq_len, dim // 2]`` with entry ``(p, j) =
    exp(i * p * theta ** (-2j / dim))``; angles, cos and sin computed in float64.

    With ``scaling`` (a dict like Hugging Face's ``rope_parameters``, see
    :class:`RotaryEmbedding`) the entry is ``attention_scaling * exp(i * p *
    inv_freq[j])`` for that rule; ``seq_len`` matters only for ``dynamic`` and
    ``longrope`` (0: the frequencies a model starts with).

    ``angle_dtype="float32"`` (or ``torch.float32``) reproduces the fp32-angle
    tables of Hugging Face / Meta: ``float32(p) * float32(inv_freq[j])``
    rounded to float32, then cos/sin of that angle (in float64, rounded once).
    Its phase error grows with ``p`` (README "Precision")."""
    _table_args("freqs_table", dim, theta, seq_len, max_seq_len)
    if scaling is None and seq_len == 0 and str(angle_dtype) in ("float64", "torch.float64"):
        return _C.rope_freqs(dim, max_seq_len, theta, who="freqs_table")
    return _C.rope_freqs(dim, max_seq_len, theta, scaling, seq_len, angle_dtype=angle_dtype, who="freqs_table")


def inv_frequencies(
    dim: int,
    theta: float = 10000.0,
    scaling: Optional[Mapping[str, Any]] = None,
    seq_len: int = 0,
) -> Tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a frequency rule: the float64
    frequencies ``[dim // 2]`` (pair ``j`` turns by ``pos * inv_freq[j]``) and
    the factor folded into every table entry. :func:`freqs_table` builds the
    complex64 table from the same rule."""
    _table_args("inv_frequencies", dim, theta, seq_len)
    return _C.rope_frequencies(dim, theta, scaling, seq_len, who="inv_frequencies")


def sinusoidal_table(n: int, d: int, base: float = 10000.0) -> torch.Tensor:
    """float32 ``[n, d]`` additive table: ``pe[pos, 2i] = sin(pos / base^(2i/d))``,
    ``pe[pos, 2i+1] = cos(...)``, in float64 and rounded once (for comparison)."""
    op = "sinusoidal_table"
    return _C.sinusoidal_table(_index_arg(op, "n", n), _index_arg(op, "d", d), _real_arg(op, "base", base))


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """float32 ``[n_heads]`` ALiBi slopes ``2^(-8 (h + 1) / n_heads)``."""
    return _C.alibi_slopes(_index_arg("alibi_slopes", "n_heads", n_heads))


def alibi_bias(n_heads: int, seq_len: int, causal: bool = True) -> torch.Tensor:
    """float32 ``[n_heads, seq_len, seq_len]`` ALiBi bias ``-slope[h] * |i - j|``
    (``-inf`` where ``j > i`` when causal)."""
    op = "alibi_bias"
    return _C.alibi_bias(_index_arg(op, "n_heads", n_heads), _index_arg(op, "seq_len", seq_len), causal)


def rope_freqs(*args, **kwargs) -> torch.Tensor:
    """Deprecated alias of :func:`freqs_table` (removed in the next release)."""
    warnings.warn(
        "rotary.rope_freqs is deprecated; use rotary.freqs_table (same arguments)", DeprecationWarning, stacklevel=2
    )
    return freqs_table(*args, **kwargs)


def rope_frequencies(*args, **kwargs) -> Tuple[torch.Tensor, float]:
    """Deprecated alias of :func:`inv_frequencies` (removed in the next release)."""
    warnings.warn(
        "rotary.rope_frequencies is deprecated; use rotary.inv_frequencies (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    return inv_frequencies(*args, **kwargs)


# The old rank rule (C++'s, the one definition) for every rank a positions
# tensor can have: a dict lookup, which torch.compile traces.
_LEGACY_ARE_IDS = {(d, v): _C.legacy_positions_are_ids(d, v) for d in range(9) for v in (False, True)}


def _legacy_positions(positions: torch.Tensor, start_pos, varlen: bool, who: str):
    """``(start_pos, offsets, position_ids)`` for the deprecated ``positions=``
    argument, with its old meaning decided by rank alone: ``[]`` / ``[batch]``
    offsets and ``[batch, seq]`` ids (packed: ``[]`` offset, ``[total_tokens]``
    ids), the ids added to ``start_pos``."""
    if not torch.compiler.is_compiling():  # a warning is a graph break; eager callers see it
        warnings.warn(f"{who}: {_C.LEGACY_POSITIONS_WARNING}", DeprecationWarning, stacklevel=3)
    is_ids = _LEGACY_ARE_IDS.get((positions.dim(), bool(varlen)))
    if not (is_ids if is_ids is not None else _C.legacy_positions_are_ids(positions.dim(), varlen)):
        return start_pos, positions, None
    # The old rule: ids were added to start_pos. Traced, with arguments that
    # pass C++'s checks, in torch ops (the op checks the sums it gets).
    integer = not (positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool)
    if integer and (isinstance(start_pos, torch.SymInt) or (
            torch.compiler.is_compiling() and type(start_pos) is int and 0 <= start_pos < _C.MAX_POSITION)):
        return 0, None, positions.to(torch.int64) + start_pos
    if not isinstance(start_pos, (int, torch.SymInt)) or isinstance(start_pos, bool):
        raise TypeError(f"{who}: start_pos must be an int, got {start_pos!r}")
    return 0, None, _C.legacy_ids(who, positions, start_pos)  # checked, in int64


def _route(positions, offsets, position_ids, start_pos, cu_seqlens, who):
    start_pos = _start_pos(who, start_pos)  # before a deprecated positions= folds it into ids
    if positions is None:
        return start_pos, offsets, position_ids
    if offsets is not None or position_ids is not None:
        raise ValueError(f"{who}: positions= is deprecated; pass offsets= or position_ids= alone")
    if not isinstance(positions, torch.Tensor) and not hasattr(type(positions), "__torch_function__"):
        _tensor_arg(who, "positions", positions)  # raises, by name
    return _legacy_positions(positions, start_pos, cu_seqlens is not None, who)


_ARGS_DOC = """
    ``freqs`` is the complex64 table ``[max_seq_len, rotary_dim // 2]``; dims
    past ``rotary_dim`` (<= head_dim) pass through unchanged.
    Inputs are ``[batch, heads, seq, head_dim]`` in ``layout`` (``"BHSD"``,
    ``"BSHD"`` or ``"SBHD"``; any strides, no copies), or packed
    ``[total_tokens, heads, head_dim]`` with ``cu_seqlens`` (int32/int64
    ``[num_seqs + 1]``). dtypes: fp32, fp64, fp16, bf16 (16-bit math in fp32,
    rounded once).

    Token ``s`` uses table row ``start_pos + s`` (``s`` counted within its own
    sequence when packed). Pass at most one of:

    * ``offsets``: per-sequence starts, ``[]`` or ``[batch]`` (packed: ``[]``
      or ``[num_seqs]``); token ``s`` of batch (or sequence) ``b`` is at
      ``start_pos + offsets[b] + s``.
    * ``position_ids``: absolute positions as in Hugging Face, ``[seq]`` or
      ``[batch, seq]`` (packed: ``[total_tokens]``). ``start_pos`` must be 0
      with them (a ``ValueError`` otherwise): add any origin to the ids.

    Both take any integer dtype (int64 and int32 are read without a copy).
    ``positions=`` is their deprecated predecessor (rank decided the meaning);
    it still works for one release, with a ``DeprecationWarning``.
    ``interleaved=True`` pairs dims (0,1), (2,3), ...; ``False`` pairs
    (j, j + rotary_dim/2) as Hugging Face ``rotate_half`` does.
    ``inverse=True`` rotates by the negative angle. With ``inv_freq``
    (float64 ``[rotary_dim // 2]``), positions past the table are computed
    exactly instead of raising.

    ``rotary_offset`` moves the rotated span to dims ``[rotary_offset,
    rotary_offset + rotary_dim)``; the rest pass through (DeepSeek's
    ``[nope | rope]`` heads, no copies). ``pair_axes`` (``rotary_dim // 2``
    ints) turns on N-D positions (M-RoPE, axial): ``position_ids`` then has a
    leading axis dim, ``[n_axes, seq]``, ``[n_axes, batch, seq]`` or packed
    ``[n_axes, total_tokens]``, and pair ``j`` turns by
    ``position_ids[pair_axes[j], ...]``. A token whose axes agree gets the
    1-D rotation exactly.
"""


# The op wrappers, generated from the registered schemas (whose argument
# lists rotary/op_args.h writes once): each passes only the keyword
# arguments that differ from the schema's defaults (torch parses a custom
# op's keywords slowly, and a decode call passes none), refuses a bool or a
# float where an int goes, anything but a bool where a bool goes, an int
# past int64, or anything but a tensor where a tensor goes, by name, and
# returns what it rotated.
_ANNOTATION = {"Tensor": "torch.Tensor", "Optional[Tensor]": "Optional[torch.Tensor]", "int": "int",
               "bool": "bool", "str": "str", "float": "float", "Optional[List[int]]": "Optional[Sequence[int]]"}
_CHECK = {"int": "_int_arg", "float": "_float_arg", "bool": "_bool_arg", "Optional[List[int]]": "_pair_axes",
          "Optional[Tensor]": "_tensor_arg", "str": "_str_arg"}


_TENSOR = torch.Tensor

# The ops that had positions= before offsets= / position_ids= replaced it.
_LEGACY_POSITIONS = ("apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_")


def _generate(name: str, returns: Optional[str], doc: str):
    schema = getattr(torch.ops.rotary, name).default._schema
    names = {arg.name for arg in schema.arguments}
    legacy = name in _LEGACY_POSITIONS  # positions= (deprecated)
    params, star, call, body = [], False, [], []
    if legacy:
        body.append(f"start_pos, offsets, position_ids = _route(positions, offsets, position_ids, start_pos, "
                    f"cu_seqlens, {name!r})")
    elif "start_pos" in names:
        body.append(f"start_pos = _start_pos({name!r}, start_pos)")
    body.append("kw = {}")
    for arg in schema.arguments:
        kind = str(arg.type)
        ann = _ANNOTATION[kind]
        if arg.kwarg_only and not star:
            params.append("*")
            star = True
        if arg.default_value is None and not kind.startswith("Optional"):
            params.append(f"{arg.name}: {ann}")
        else:
            params.append(f"{arg.name}: {ann} = {arg.default_value!r}")
        if not arg.kwarg_only:
            call.append(arg.name)
            if kind == "bool":  # the other positional ones are tensors and start_pos (checked above)
                body.append(f"if type({arg.name}) is not bool: _bool_arg({name!r}, {arg.name!r}, {arg.name})")
            elif kind == "Tensor":  # anything with __torch_function__ (an FX Proxy) is torch's to route
                body.append(f"if not isinstance({arg.name}, _TENSOR) and not hasattr(type({arg.name}), "
                            f"'__torch_function__'): _required_tensor({name!r}, {arg.name!r}, {arg.name})")
            elif kind == "Optional[Tensor]":  # apply_rope_cos_sin's sin
                body.append(f"if {arg.name} is not None and not isinstance({arg.name}, _TENSOR) and not hasattr("
                            f"type({arg.name}), '__torch_function__'): _tensor_arg({name!r}, {arg.name!r}, "
                            f"{arg.name})")
            continue
        check = _CHECK.get(kind)
        value = f"{check}({name!r}, {arg.name!r}, {arg.name})" if check else arg.name
        if kind == "Optional[Tensor]":  # a plain tensor passes with one type test, no call
            value = f"{arg.name} if type({arg.name}) is _TENSOR else {value}"
        if arg.default_value is None:
            body.append(f"if {arg.name} is not None: kw[{arg.name!r}] = {value}")
        else:  # `type(...) is` keeps a bool from equalling 0 or 1
            default = arg.default_value
            body.append(f"if not (type({arg.name}) is {type(default).__name__} and {arg.name} == {default!r}): "
                        f"kw[{arg.name!r}] = {value}")
    if legacy:
        params.append("positions: Optional[torch.Tensor] = None")
    body.append(f"out = _OP_{name}({', '.join(call)}, **kw)")
    body.append(f"return {returns or 'out'}")
    src = f"def {name}({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
    # In this module's namespace: torch.compile guards on a function's globals by module name.
    scope = globals()
    scope[f"_OP_{name}"] = getattr(torch.ops.rotary, name).default
    exec(compile(src, f"<rotary._ops {name}>", "exec"), scope)
    fn = scope[name]
    fn.__module__, fn.__doc__ = __name__, doc
    return fn


apply_rope = _generate("apply_rope", None, "Rotate ``x`` and return a new tensor." + _ARGS_DOC)
apply_rope_qk = _generate("apply_rope_qk", None, """Rotate q and k in one kernel call (head counts may differ; batch, seq
    and head_dim must match). Returns ``(q_rotated, k_rotated)``.""" + _ARGS_DOC)
apply_rope_ = _generate("apply_rope_", "x", """Rotate ``x`` in place and return it. Every input is validated before
    anything is written. Not differentiable: a tensor that requires grad (with
    grad mode on) is refused.""" + _ARGS_DOC)
apply_rope_qk_ = _generate("apply_rope_qk_", "q, k", """Rotate q and k in place (they may be views into one packed qkv tensor)
    and return them. Not differentiable, like :func:`apply_rope_`.""" + _ARGS_DOC)

apply_rope_with_kv_cache_ = _generate("apply_rope_with_kv_cache_", "q, k", """Rotate q and k in place, as :func:`apply_rope_qk_` does, and write the
    rotated k and the raw v of every token into ``k_cache`` / ``v_cache``, in
    one call. Returns ``(q, k)``. Positions and the q/k/v layout are those of
    :func:`apply_rope_qk_`; v has the shape of k but for head_dim (MLA's
    ``v_head_dim`` may differ; each cache's rows are its tensor's width).

    ``kv_layout``: contiguous per sequence ``"BHSD"`` ``[batch, kv_heads,
    max_seq_len, head_dim]`` or ``"BSHD"`` ``[batch, max_seq_len, kv_heads,
    head_dim]`` (packed input: one row per sequence of ``cu_seqlens``), or
    paged ``"NHD"`` ``[num_blocks, block_size, kv_heads, head_dim]`` or
    ``"HND"`` ``[num_blocks, kv_heads, block_size, head_dim]``.
    A contiguous cache takes token ``(b, s)`` at row ``cache_positions[b, s]``
    (default: its rotary position); a paged one at flat slot
    ``slot_mapping[b, s]`` (required; ``-1`` skips the token). Both are int32
    or int64, ``[batch, seq]`` or flat ``[batch * seq]`` (packed:
    ``[total_tokens]``).

    Caches have the dtype of k, or ``torch.float8_e4m3fn`` with float32
    ``k_scale`` / ``v_scale`` of shape ``[]``, ``[1]`` or ``[kv_heads]``
    (default 1): the cache holds ``(x / scale).clamp(-448, 448)`` rounded to
    nearest even, the division done once in float32 (float64 for float64 k).

    ``inverse``, ``rotary_offset`` and ``pair_axes`` are those of
    :func:`apply_rope`; the cache gets whole head vectors of k as rotated.
    With ``pair_axes`` (N-D ``position_ids``) a contiguous cache needs
    ``cache_positions``: a token's rotary positions are not its row.

    Every argument, and every slot or cache position on the host, is checked
    before anything is written. Slots and positions on the device are not
    checked (that would sync): out-of-range ones are skipped, never written
    out of bounds.""")

_NORM_DOC = """

    The norm, in fp32 (fp64 for fp64 tensors) before the rotation, one
    rounding at the end: ``norm="head"`` normalizes each head over its
    ``head_dim`` (Qwen3, Gemma 3), ``norm="heads"`` all heads of a token
    together (OLMo2). ``q_weight`` / ``k_weight``: ``[head_dim]``, or
    ``[heads * head_dim]`` of that tensor for ``"heads"``; ``None`` is a
    weight of ones. ``weight_offset`` is added to the weight (``1.0`` gives
    Gemma's ``1 + w``). The whole head is normalized; only the rotated span
    turns. ``q_fp8_scale`` (float32 ``[]``, ``[1]`` or ``[heads]``; out of
    place only): q is returned as ``float8_e4m3fn``, the result divided by
    the scale, clamped to +-448 and rounded once."""
apply_qk_norm_rope = _generate("apply_qk_norm_rope", None, """RMS-normalize q and k, scale them by their weights and rotate them, in
    one pass. Returns ``(q_out, k_out)``; differentiable in q, k and both
    weights.""" + _NORM_DOC + _ARGS_DOC)
apply_qk_norm_rope_ = _generate("apply_qk_norm_rope_", "q, k", """:func:`apply_qk_norm_rope` in place (q and k may be views of one
    packed qkv tensor); returns ``(q, k)``. Not differentiable.""" + _NORM_DOC + _ARGS_DOC)
apply_qk_norm_rope_with_kv_cache_ = _generate("apply_qk_norm_rope_with_kv_cache_", "q, k", """The prologue with the KV-cache write, in one call: q and k normalized
    and rotated in place as :func:`apply_qk_norm_rope_` does, then k (as
    normalized and rotated) and the raw v written into ``k_cache`` /
    ``v_cache`` as :func:`apply_rope_with_kv_cache_` writes them, in every
    cache layout and dtype it takes (contiguous, paged, float8_e4m3fn).
    Returns ``(q, k)``. Not differentiable.""" + _NORM_DOC)

apply_rope_cos_sin = _generate("apply_rope_cos_sin", None, """Rotate q and k by cos/sin tables as callers hand them; returns
    ``(q_rotated, k_rotated)``, differentiable in q and k.

    * Hugging Face: ``cos``, ``sin`` ``[seq, R]`` or ``[batch | 1, seq, R]``
      (R = rotary_dim), the pair its rotary embedding returns, in any float
      dtype. rotate_half tables repeat their first R/2 values (``interleaved=True``:
      each value twice, as ``repeat_interleave`` builds them); that is checked,
      and other tables are an error. With ``position_ids`` they are
      ``[max_pos, R]`` tables indexed by it.
    * vLLM / FlashInfer: ``sin=None`` and ``cos`` the ``cos_sin_cache``
      ``[max_pos, R]`` (R/2 cos then R/2 sin per row) with ``position_ids``.

    ``position_ids``: ``[seq]`` or ``[batch, seq]`` (batch may be 1), any integer dtype. q and
    k are 4-D in ``layout`` (``"BHSD"``: Hugging Face's ``unsqueeze_dim=1``,
    ``"BSHD"``: ``unsqueeze_dim=2``, ``"SBHD"``), or ``[tokens, heads,
    head_dim]`` (vLLM's, positions ``[tokens]``). Dims outside
    ``[rotary_offset, rotary_offset + R)`` pass through. ``interleaved``
    (default ``False``: rotate_half) and ``inverse`` are :func:`apply_rope`'s.

    A composite over :func:`apply_rope_qk` (so every backend, autograd and
    ``torch.compile`` come with it): the rows of the call are read once into
    its float32 table, then q and k are rotated in one kernel call. A caller
    that keeps its tables across calls is faster with :func:`apply_rope_qk`
    and a table built once.""")
