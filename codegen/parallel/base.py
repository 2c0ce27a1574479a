"""What every parallelism strategy shares: the parts it returns, the registry it joins, and the chips' order.

A strategy is a graph rewrite. It takes one function's operator graph and the
system, and returns a :class:`Mapping`: one :class:`Part` per chip, each a graph
of its own whose transfers are nodes (``send`` and ``recv`` between two chips,
``allgather`` and ``allreduce`` over a group of chips, :mod:`.collectives`). :mod:`.runner` compiles every
part through the same stages as a single chip. A strategy is registered with
:func:`strategy`; the codegen's options and the command line read their choices
from :data:`STRATEGIES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime_sim import ChipConfig
from ...runtime_sim.errors import LpxUserError
from ...runtime_sim.system import SystemConfig
from ..graph import Graph


class SystemCompileError(LpxUserError):
    """A model that cannot be mapped onto a system (it does not fit, or the system cannot carry it)."""


@dataclass
class Part:
    """One chip's share of a function.

    ``stored``: the indexes of ``graph.outputs`` this chip stores to its host (None: all of them). An SPMD
    rank computes every output its leader does, so that their schedules are one, and stores only its own.
    """

    chip: int
    graph: Graph
    resident_budget: int | None = None
    stored: tuple | None = None


@dataclass
class Mapping:
    """A strategy's answer: the parts, where the model's host inputs and outputs go (as
    :class:`~lpx_tvm.runtime_sim.system_sim.SystemProgram` names them), what to say about it, and what to try
    when a part does not fit its chip (``hint``).

    ``spmd``: the parts are ranks of one collective and run one schedule (the first part's), aligned at every
    transfer; otherwise the parts are compiled in order, each RECV pinned where its SEND's data arrives.
    """

    parallel: str
    parts: list
    inputs: tuple
    outputs: tuple
    notes: str
    spmd: bool = False
    hint: str = ""


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: ``split(g, chip, system, dtype, chips)`` returns a :class:`Mapping` or raises
    :class:`SystemCompileError`; ``applies(g)`` says whether the graph has what it splits (auto asks)."""

    name: str
    split: object
    applies: object
    summary: str


STRATEGIES: dict = {}


def strategy(name: str, summary: str, applies=lambda g: True):
    """Register the decorated ``split`` function as the strategy ``name``."""
    def register(split):
        if name in STRATEGIES or name == "auto":
            raise ValueError(f"a strategy named {name!r} is registered already")
        STRATEGIES[name] = Strategy(name, split, applies, summary)
        return split
    return register


def node_weights(g: Graph, node) -> set:
    """The resident tensors (weights, and state such as a KV cache) an operator reads."""
    return {g.base(t) for t in node.inputs if g.is_resident(t)}


def weight_budget(g: Graph, chip: ChipConfig) -> int:
    """Bytes of resident weights a chip may take: its SRAM less room for the activations (the four largest
    tensors the graph computes, which bounds what one stage holds live), and at least half of it."""
    activations = sorted((t.nbytes for k, t in enumerate(g.tensors) if not g.is_resident(k)), reverse=True)
    return max(chip.sram_bytes // 2, chip.sram_bytes - 2 * sum(activations[:4]) - (4 << 20))


def chip_order(system: SystemConfig, count: int) -> list:
    """``count`` chips each a neighbour of the one before where the topology allows (a walk from chip 0)."""
    if not system.links:
        return list(range(count))
    order, seen = [0], {0}
    while len(order) < count:
        here = order[-1]
        nxt = next((c for c in system.neighbours(here) if c not in seen), None)
        if nxt is None:
            nxt = next(c for c in range(system.chips) if c not in seen)
        order.append(nxt)
        seen.add(nxt)
    return order
