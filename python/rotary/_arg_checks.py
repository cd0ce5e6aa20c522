"""The Python-side argument checks of the typed wrappers (_ops.py): what
torch's argument parser would coerce (a bool for an int, 0.5 for a bool) or
refuse without naming the argument, named here. Values are C++'s to check."""

import operator
from collections.abc import Sequence

import torch

from . import _C


# numpy's integers as the int they hold (torch's parser takes them); any other
# value as it is, for the checks to name. One definition, in C++ (convert.cpp).
_plain_int = _C._plain_int
# A wrong value as the errors show it (typed: after its type's name): long lists
# and arrays by length or shape (convert.cpp, which the C++ errors use too).
_shown = _C._shown


def _int_arg(op: str, name: str, value):
    """torch's argument parser takes a bool as an int and names neither the
    argument nor the op for a float or an int past int64: refuse them here,
    by name (start_pos has its own words for the last, in _start_pos)."""
    if type(value) is int and -(2**63) <= value < 2**63:  # the decode path: one test
        return value
    if isinstance(value, torch.SymInt):
        return value
    value = _plain_int(value)
    if type(value) is not int:
        raise TypeError(f"{op}: {name} must be an int, got {_shown(value)}")
    return value if name == "start_pos" else _in_int64(op, name, value)


def _float_arg(op: str, name: str, value):
    """A float argument of an op: a float or a SymFloat as it is (the decode
    path: one test), any other real as _real_arg takes it."""
    if type(value) is float or isinstance(value, torch.SymFloat):
        return value
    return _real_arg(op, name, value)


def _index_arg(op: str, name: str, value) -> int:
    """An integer of any type pybind's int64 takes (numpy's, a one-element
    integer tensor), as an int; a bool (a bool tensor too: its __index__
    reads True as 1), a float or one past int64 refused by name."""
    is_bool = isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    try:
        index = None if is_bool else operator.index(value)
    except TypeError:
        index = None
    if index is None:
        raise TypeError(f"{op}: {name} must be an int, got {_shown(value)}")
    return _in_int64(op, name, index)


def _in_int64(op: str, name: str, value: int) -> int:
    """An int past int64 refused by name (pybind and torch's parser would
    answer an OverflowError that names neither)."""
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{op}: {name} must fit in int64, got {value}")
    return value


def _real_arg(op: str, name: str, value) -> float:
    """A real number of any type (numpy's too) as a float; a bool, a complex,
    a string or one past a float's range refused by name (convert.cpp)."""
    return _C._float_arg(value, op, name)


def _table_args(op: str, dim, theta, seq_len, max_seq_len=0):
    """pybind takes True for an int and names neither the argument nor the
    function for a float or a number past int64 / float: name them here (any
    integer type is an int); C++ checks the values (and the table's bytes)."""
    for name, value in (("dim", dim), ("max_seq_len", max_seq_len), ("seq_len", seq_len)):
        _index_arg(op, name, value)
    _real_arg(op, "theta", theta)


def _str_arg(op: str, name: str, value):
    """A string, by name (torch's parser answers None with the whole schema)."""
    if not isinstance(value, str):
        raise TypeError(f"{op}: {name} must be a str, got {_shown(value)}")
    return value


def _bool_arg(op: str, name: str, value):
    """A bool, by name: torch's argument parser takes None, 0, 2 or 0.5 for a
    bool, and a flag read the wrong way rotates silently the other way."""
    if type(value) is not bool:
        raise TypeError(f"{op}: {name} must be a bool, got {_shown(value)}")
    return value


_SCALES = ("k_scale", "v_scale", "q_fp8_scale")  # float32 tensors: a float's one fix


def _tensor_arg(op: str, name: str, value):
    """A tensor, by name: torch's argument parser answers a float scale with
    the whole schema."""
    if not isinstance(value, torch.Tensor):
        hint = f"; pass torch.tensor({value!r}, dtype=torch.float32)" if (
            isinstance(value, float) and name in _SCALES) else ""
        raise TypeError(f"{op}: {name} must be a tensor or None, got {_shown(value, typed=True)}{hint}")
    return value


def _required_tensor(op: str, name: str, value):
    """Anything but a tensor where one is required: None reached C++ as an
    undefined tensor, in C++'s words."""
    raise TypeError(f"{op}: {name} must be a tensor, got {_shown(value, typed=True)}")


def _pair_axes(op: str, name: str, value):
    if value is None:
        return None  # 1-D positions
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{op}: {name} must be a list of ints or None, got {_shown(value)}")
    out = list(value)
    # Plain ints in int64 (a call's usual list) pass in one sweep; the entry
    # at fault is named by _int_arg, whose per-entry names cost microseconds.
    if set(map(type, out)) <= {int} and (not out or (-(2**63) <= min(out) and max(out) < 2**63)):
        return out
    return [_int_arg(op, f"{name}[{j}]", a) for j, a in enumerate(out)]


def _start_pos(op: str, start_pos):
    """A Python int outside int64 never reaches the C++ check: torch's
    argument parser refuses it with a message about its own types. Name the
    argument and the bound instead (the C++ check)."""
    start_pos = _int_arg(op, "start_pos", start_pos)
    if isinstance(start_pos, int) and not -(2**63) <= start_pos < 2**63:
        _C.check_start_pos(start_pos, op)  # raises
    return start_pos
