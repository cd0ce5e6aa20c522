"""The life of ``rotary.RotaryEmbedding``'s two table buffers in
``nn.Module``'s machinery: assignment, ``load_state_dict``, moves and casts
(``_apply``), pickling. The tables are one pair, built and checked by
``self._tables`` (``rotary._C.RopeTables``); the subclass builds them and
rotates with them (module.py)."""

import torch
from torch import nn

from ._arg_checks import _shown
from ._cpp_wrappers import hand_out_copies, move_of

_TABLES = ("freqs", "inv_freq")
_LAYOUT_FIELDS = ("rotary_offset", "mrope_section", "mrope_interleaved", "axes_dim", "pair_axes")


def layout_of(tables) -> tuple:
    """(rotary_offset, axes_dim, pair_axes) of a RopeTables: read once, kept as
    plain values for forward (pair_axes: the pair -> axis map, rotary/axes.h; None: 1-D)."""
    return tables.rotary_offset, tables.axes_dim, tables.pair_axes


class TableBuffers(nn.Module):
    """``freqs`` and ``inv_freq`` kept as one pair through nn.Module's own
    paths (the subclass sets ``_tables`` and ``_layout``)."""

    def _holds_pair(self) -> bool:  # both tables in _buffers (a caller may have popped one)
        return len(self._buffers.keys() & set(_TABLES)) == 2

    def _held(self):  # the tables held, read under the state machine's lock
        return self._buffers["freqs"], self._buffers["inv_freq"]

    def _install(self, freqs: torch.Tensor, inv_freq: torch.Tensor) -> None:
        self._buffers["freqs"], self._buffers["inv_freq"] = freqs, inv_freq

    def __setattr__(self, name, value):
        # The tables are one pair built from the options: a freqs swapped alone
        # served positions past it from the old inv_freq. An assignment (as
        # transformers' from_pretrained loads each buffer) is a checked load of
        # that piece, the pair rebuilt to match on the tensor's device; one
        # not of these options is refused. (functional_call and export swap
        # _buffers directly.)
        if name in _TABLES and "_tables" in self.__dict__ and value is not self._buffers.get(name):
            self._load_one(name, value, f"RotaryEmbedding.{name} = ...")
            return
        super().__setattr__(name, value)

    def __delattr__(self, name):
        # forward reads the pair from _buffers: a table deleted (or moved
        # under torch.nn.utils.parametrize, which deletes it first) raised KeyError there.
        if name in _TABLES and name in self._buffers and "_tables" in self.__dict__:
            self._keep_tables()
            raise AttributeError(f"RotaryEmbedding.{name} cannot be deleted or parametrized: the module rotates "
                                 f"with the pair of tables its options build (assign a table, or build a module "
                                 f"with other options)")
        super().__delattr__(name)

    def _keep_tables(self):  # parametrize wrote into the table before deleting it (RopeTables.keep)
        if self._holds_pair():  # one popped from _buffers: no pair to keep
            self._tables.keep(*self._held(), "RotaryEmbedding", self._install)

    def register_buffer(self, name, tensor, persistent=True):
        if name in _TABLES and name in self._buffers and "_tables" in self.__dict__ and tensor is not self._buffers[name]:
            self._load_one(name, tensor, f"RotaryEmbedding.register_buffer({name!r})")
            (self._non_persistent_buffers_set.discard if persistent else self._non_persistent_buffers_set.add)(name)
            return
        super().register_buffer(name, tensor, persistent)

    def _load_one(self, name, value, who):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a tensor (one of the module's two tables), got "
                            f"{_shown(value, True)}")
        if value.is_meta:  # a meta tensor holds no values to check: the pair goes to meta, as a move would
            self._install(*(t.to("meta") for t in self._held()))
            return
        pair = (value, None) if name == "freqs" else (None, value)
        self._tables.restore(*pair, who, value.device, self._install)  # the device given, as assign=True

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        # Saved tables are never installed as they are: RopeTables checks them
        # against the options and rebuilds both buffers in the state they were
        # saved in. A mismatch is a load error that leaves the buffers as they were.
        fkey, ikey = prefix + "freqs", prefix + "inv_freq"
        given = fkey in state_dict or ikey in state_dict
        if given:
            # assign=True (loading into a meta-initialised model) takes the saved tensors' device, as torch does.
            saved = state_dict.get(fkey, state_dict.get(ikey))
            device = self.freqs.device
            if local_metadata.get("assign_to_params_buffers") and isinstance(saved, torch.Tensor) and not saved.is_meta:
                device = saved.device
            bad = [key for key in (fkey, ikey) if key in state_dict and not isinstance(state_dict[key], torch.Tensor)]
            try:
                if bad:  # None too: not "left out" (restore's None); torch refuses a None entry too
                    raise TypeError(f"RotaryEmbedding.load_state_dict: the saved '{bad[0][len(prefix):]}' must be "
                                    f"a tensor, got {_shown(state_dict[bad[0]])}")
                self._tables.restore(state_dict.get(fkey), state_dict.get(ikey), "RotaryEmbedding.load_state_dict",
                                     device, self._install)
            except (ValueError, TypeError) as e:
                error_msgs.append(str(e))
            state_dict = dict(state_dict)  # the caller's dict is left alone
            for key, buf in ((fkey, self.freqs), (ikey, self.inv_freq)):
                if key in state_dict:
                    state_dict[key] = buf
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs)
        if not given and not self.freqs.is_meta:  # the tables follow from the options; it keeps its own
            missing[:] = [key for key in missing if key not in (fkey, ikey)]

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) would cast the complex table to a real dtype and
        # drop the sines, and round inv_freq; take only the device from fn.
        # A move that raises (.cuda() without a GPU) keeps the tables. Meta
        # tables hold no values: leaving meta (to_empty) rebuilds them.
        self._follow_held()  # a rebuild below is of the state of the tables held
        saved = {name: self._buffers[name] for name in _TABLES if name in self._buffers}
        tables = {id(buf) for buf in saved.values()}
        moved = saved
        try:
            # The tables stay in _buffers throughout: a call on another thread reads them (one that found them
            # popped raised KeyError: 'freqs'); fn passes them by.
            super()._apply(lambda t: t if id(t) in tables else fn(t), recurse)
            where = {name: move_of(fn, buf.device) for name, buf in saved.items()}
            if saved and all(w is None for w in where.values()):
                moved = {name: fn(buf) for name, buf in saved.items()}  # share_memory_: the tables themselves
            elif len(saved) == 2 and saved["freqs"].is_meta and where["freqs"].type != "meta":
                moved = dict(zip(_TABLES, self._tables.build(where["freqs"])))
            else:
                moved = {name: buf.to(where[name]) for name, buf in saved.items()}
        finally:
            self._buffers.update(moved)
        if len(moved) == 2:
            self._tables.own((moved["freqs"], moved["inv_freq"]))
        return self

    def _held_pair(self):
        # The pair as held under the state machine's lock: another thread's
        # call may install new tables while a copy reads them (one by one).
        # (A rule that is not host-driven has one state: state_of reads nothing.)
        held = []
        self._tables.state_of(lambda: held.append(self._held()) or held[0])
        return held[0] if held else self._held()

    def __getstate__(self):  # pickle, deepcopy: the state of the tables held, not of the last switch
        state = super().__getstate__()
        if self._holds_pair():
            freqs, inv_freq = self._held_pair()
            state = dict(state, _buffers={**self._buffers, "freqs": freqs, "inv_freq": inv_freq})
        return state

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars and self._holds_pair():  # keep_vars: the tensors themselves
            hand_out_copies(destination, prefix, dict(zip(_TABLES, self._held_pair())))

    def __setstate__(self, state):
        # A module pickled before the options became read-only kept them as plain attributes.
        state = {k: v for k, v in state.items() if k not in _LAYOUT_FIELDS}
        super().__setstate__(state)
        if "_layout" not in state and "_tables" in state:
            self._layout = layout_of(self._tables)

    def _follow_held(self) -> None:  # the state machine takes the state of the tables held (both present)
        if self._holds_pair():
            self._tables.state_of(self._held)
