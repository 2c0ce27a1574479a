"""alloc: place every tensor in SRAM.

Weights (constants) are resident: they sit at the bottom of SRAM for the life of
the program. Activations are placed by liveness, in program order, next fit: a
tensor's space is taken just before its first writer and returned after its last
reader, and the search for space starts where the last one ended, so freed space
is reused as late as possible: reuse makes the next tensor wait for the last
reader of the old one, which the scheduler would otherwise have overlapped. Nothing is ever placed past capacity:
a program that cannot fit raises :class:`CapacityError` naming the layer and the
sizes.
"""

from __future__ import annotations

import contextlib
import contextvars

from ..runtime_sim import ChipConfig
from ..runtime_sim.errors import LpxUserError
from .graph import Graph, layer_label

ALIGN = 64
REUSE_WINDOW_BYTES = 16 << 20


class CapacityError(LpxUserError):
    """The tensors live at some point do not fit in SRAM."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _FreeList:
    """Free SRAM as sorted, disjoint ``[lo, hi)`` blocks, handed out next fit."""

    def __init__(self, start: int, end: int, window: int):
        self.blocks = [(start, end)]
        self.high_water = start
        self.cursor = start
        self.window = window  # next fit wraps here, so a program's SRAM stays near its live peak

    def take(self, size: int) -> int | None:
        for wrapped in (False, True):
            for i, (lo, hi) in enumerate(self.blocks):
                start = lo if wrapped else max(lo, self.cursor)
                if not wrapped and (start + size > self.window or hi - start < size):
                    continue
                if hi - start < size:
                    continue
                pieces = ([(lo, start)] if start > lo else []) + ([(start + size, hi)] if start + size < hi else [])
                self.blocks[i:i + 1] = pieces
                self.high_water = max(self.high_water, start + size)
                self.cursor = start + size
                return start
        return None

    def give(self, lo: int, size: int) -> None:
        hi = lo + size
        blocks = sorted(self.blocks + [(lo, hi)])
        merged = [blocks[0]]
        for b_lo, b_hi in blocks[1:]:
            if b_lo == merged[-1][1]:
                merged[-1] = (merged[-1][0], b_hi)
            else:
                merged.append((b_lo, b_hi))
        self.blocks = merged


def _peak_live(g: Graph, first: dict, last: dict, n_ops: int) -> int:
    """The most activation bytes live at once (aligned), by program order."""
    delta = [0] * (n_ops + 1)
    for base, i in first.items():
        delta[i] += _align(g.tensors[base].nbytes)
        delta[last[base] + 1] -= _align(g.tensors[base].nbytes)
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def resident_bytes(g: Graph, ops: list) -> int:
    """SRAM the constants ``ops`` use take, aligned as :func:`allocate` places them."""
    bases = {g.base(o.tensor) for op in ops for o in op.srcs + op.dsts if o.tensor is not None}
    return sum(_align(g.tensors[b].nbytes) for b in bases if g.is_resident(b))


_HELD = contextvars.ContextVar("lpx_held_weights", default=None)


@contextlib.contextmanager
def held_weights_first(held):
    """Within this block, constants that lie in ``held``'s arrays (a
    :class:`~lpx_tvm.runtime_sim.held.HeldWeights`) are placed first, in the order of its names, the others
    after them in the order they are first used: two models compiled over the same weights (a decoder's
    prefill and decode) place each weight they both read at the same address, on a chip that reads the same
    ones, so the chip keeps one copy resident for both."""
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)


def current_held():
    """The :class:`~lpx_tvm.runtime_sim.held.HeldWeights` of :func:`held_weights_first`'s block, or None."""
    return _HELD.get()


def _resident_order(g: Graph, resident: list) -> list:
    """``resident`` (bases in first-use order) in the order they are placed (see :func:`held_weights_first`)."""
    held = _HELD.get()
    if held is None:
        return resident
    keys = {}
    for position, base in enumerate(resident):
        where = held.place(g.tensors[base].data)
        keys[base] = (0, held.order[where[0]], where[1]) if where else (1, position, 0)
    return sorted(resident, key=keys.__getitem__)


def _liveness(g: Graph, ops: list, const_base: int) -> tuple:
    """Constants' addresses from ``const_base`` up, the top of them, and each activation's first and last op."""
    resident, first, last = {}, {}, {}
    for i, op in enumerate(ops):
        for operand in op.dsts + op.srcs:
            if operand.tensor is None:  # a chained stream: no SRAM
                continue
            base = g.base(operand.tensor)
            if g.is_resident(base):
                resident.setdefault(base, None)
                continue
            first.setdefault(base, i)
            last[base] = i
    addr, cursor = {}, _align(const_base)
    for base in _resident_order(g, list(resident)):
        addr[base] = cursor
        cursor += _align(g.tensors[base].nbytes)
    return addr, cursor, first, last


def activation_peak(g: Graph, ops: list) -> int:
    """The most activation bytes ``ops`` hold live at once (aligned, by program order): what SRAM must leave
    free beside the weights."""
    _, _, first, last = _liveness(g, ops, 0)
    return _peak_live(g, first, last, len(ops))


def _largest_weights(g: Graph, ops: list, count: int = 3) -> str:
    """The ``count`` largest resident tensors with the layer that reads each, for an error message."""
    readers = {}
    for op in ops:
        for operand in op.srcs:
            if operand.tensor is not None and g.is_resident(g.base(operand.tensor)):
                readers.setdefault(g.base(operand.tensor), op.layer)
    biggest = sorted(readers, key=lambda t: -g.tensors[t].nbytes)[:count]
    return ", ".join(f"{g.tensors[t].nbytes} bytes in {layer_label(readers[t])}" for t in biggest)


def allocate(g: Graph, ops: list, config: ChipConfig, const_base: int = 0, activation_base: int | None = None) -> dict:
    """SRAM address of every base tensor used by ``ops``.

    Constants go from ``const_base`` up; activations from ``activation_base``
    (default: right above the constants). A model's programs share one chip: each
    gets its own constant range, and all put their activations above every one.

    Returns
    -------
    dict
        tensor id -> byte address, plus ``"high_water"``: the top of used SRAM.
    """
    addr, cursor, first, last = _liveness(g, ops, const_base)
    if activation_base is not None:
        if cursor > activation_base:
            raise CapacityError(f"weights need {cursor - const_base} bytes, more than the "
                                f"{activation_base - const_base} the model's SRAM plan left this program. The largest: "
                                f"{_largest_weights(g, ops)}. Store them smaller (dtype fp16, fp8 or int8) or spread "
                                "the model over a system of chips (system=..., --system)")
        cursor = activation_base
    if cursor > config.sram_bytes:
        raise CapacityError(f"weights need {cursor} bytes of SRAM; chip {config.name!r} has {config.sram_bytes}. "
                            f"The largest: {_largest_weights(g, ops)}. Store them smaller (dtype fp16, fp8 or "
                            "int8) or spread the model over a system of chips (system=..., --system)")
    peak = _peak_live(g, first, last, len(ops))
    # the wider the window, the later freed space is reused (fewer false dependences for the scheduler);
    # bounded so that a program's SRAM, and the simulator's image of it, stays near what it needs
    window = min(config.sram_bytes, cursor + max(4 * peak, REUSE_WINDOW_BYTES))
    free = _FreeList(cursor, config.sram_bytes, window=window)
    ends_at = {}
    for base, i in last.items():
        ends_at.setdefault(i, []).append(base)
    starts_at = {}
    for base, i in first.items():
        starts_at.setdefault(i, []).append(base)
    for i, op in enumerate(ops):
        for base in starts_at.get(i, ()):
            size = _align(g.tensors[base].nbytes)
            where = free.take(size)
            if where is None:
                live = config.sram_bytes - sum(h - l for l, h in free.blocks)
                raise CapacityError(
                    f"layer {layer_label(op.layer)}: a {size}-byte tensor {g.tensors[base].shape} does not fit in SRAM "
                    f"({config.sram_bytes} bytes on chip {config.name!r}, {live} already in use, "
                    f"{cursor} of them weights)")
            addr[base] = where
        for base in ends_at.get(i, ()):
            free.give(addr[base], _align(g.tensors[base].nbytes))
    addr["high_water"] = free.high_water
    return addr
