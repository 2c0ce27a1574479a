"""Collectives that fit the topology: which chips take part, which algorithm, and every rank's exchanges.

A collective over T chips is chosen from the system's links, as NCCL picks ring, tree or NVLS from the
topology:

- ``direct``: every pair of the T chips is joined by a link (a TSP or LPX node). Each chip sends to every
  other at once, over its own links: a reduce-scatter and an all-gather are one hop each, whatever T is.
- ``hierarchical``: the T chips are ``nodes`` × ``per_node``, all to all within a node, and each chip joined to
  the chip in the same position of every other node (an LPX rack). A reduce-scatter is one direct step within
  the node and one across the nodes; an all-gather the same in reverse: two hops each.
- ``ring``: anything else with a ring through it (the tiny test systems): T − 1 steps of one hop each.

A small all-reduce (a decode step's hidden state) may go **one-shot** instead (:meth:`Group.one_shot`): each chip
sends its whole partial sums to every peer and adds them all, one hop a level; across a grid of nodes half the
columns go within the node first and half across first, side by side.

An **all-to-all** (a mixture of experts' dispatch and combine) sends each peer its own block at once, one hop, on
a fully connected group (:meth:`Group.all_to_all`).

Several links between two chips carry one exchange side by side (its blocks, or pieces of one block).

The algorithm is described in blocks: a tensor cut along one axis into T blocks, and each rank's exchanges
say which blocks it sends to which chip over which ports, which blocks it receives, and (reduce-scatter)
which of its partial sums each received block is added into. :meth:`~lpx_tvm.codegen.tile` emits these as
SEND, RECV and ADD; :mod:`lpx_tvm.app.plan.search` compiles the same all-reduces into the block it measures, so the
plan and the compiled program use one algorithm over one topology.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from ...runtime_sim.errors import LpxUserError
from ...runtime_sim.system import SystemConfig


class CollectiveError(LpxUserError):
    """T chips of a system that no collective algorithm joins."""


@dataclass(frozen=True)
class Exchange:
    """One exchange of a collective seen from one rank: ``send`` blocks go to chip ``to`` over this chip's
    ``to_ports``; ``recv`` blocks come from chip ``frm`` on this chip's ``frm_ports``; with a reduce, each
    received block is added into the partial sums' block ``add_into`` (one for one)."""

    to: int
    to_ports: tuple
    frm: int
    frm_ports: tuple
    send: tuple
    recv: tuple
    add_into: tuple = ()


@dataclass(frozen=True)
class Phase:
    """Exchanges that run side by side (``direct``, ``hierarchical``), or one after another, each sending
    what the one before received (``ring``). ``reduce``: received blocks are partial sums to add."""

    exchanges: tuple
    reduce: bool
    hops: int = 1


@dataclass(frozen=True)
class Group:
    """The chips of one collective, in rank order, and the algorithm that joins them.

    ``hierarchical``: rank ``r`` is position ``r % per_node`` of node ``r // per_node``.
    """

    algorithm: str
    chips: tuple
    system: SystemConfig
    nodes: int = 1

    @property
    def ranks(self) -> int:
        return len(self.chips)

    @property
    def diameter(self) -> int:
        """Hops between the group's two farthest chips: one all linked, two across a grid's nodes, half a ring."""
        return {"direct": 1, "hierarchical": 2}.get(self.algorithm, self.ranks // 2)

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    def _ports(self, rank: int, peer_rank: int) -> tuple:
        """This chip's ports on every link to ``peer_rank``'s chip, the same links in the same order seen from
        either end (a one-hop route; the ring's neighbours are linked)."""
        here, there = self.chips[rank % self.ranks], self.chips[peer_rank % self.ranks]
        return tuple(port for port, _ in self.system.links_between(here, there))

    def _exchange(self, rank, to_rank, from_rank, send, recv, add_into=()) -> Exchange:
        return Exchange(self.chips[to_rank % self.ranks], self._ports(rank, to_rank),
                        self.chips[from_rank % self.ranks], self._ports(rank, from_rank),
                        tuple(b % self.ranks for b in send), tuple(b % self.ranks for b in recv),
                        tuple(b % self.ranks for b in add_into))

    # ---- all-gather: rank r holds block owner(r) and ends with all of them ----------------------------------
    def gather(self, rank: int, owner=lambda r: r) -> tuple:
        """The phases of an all-gather in which rank ``k`` starts with block ``owner(k)``."""
        t = self.ranks
        if self.algorithm == "ring":
            # step s: pass on the block received at step s - 1 (at step 1: this rank's own)
            return (Phase(tuple(self._exchange(rank, rank + 1, rank - 1, (owner((rank - s + 1) % t),),
                                               (owner((rank - s) % t),)) for s in range(1, t)), False),)
        if self.algorithm == "direct":
            return (Phase(tuple(self._exchange(rank, rank + s, rank - s, (owner(rank),),
                                               (owner((rank - s) % t),)) for s in range(1, t)), False),)
        k, m = self.per_node, self.nodes
        n, i = divmod(rank, k)
        across = Phase(tuple(self._exchange(rank, (n + u) % m * k + i, (n - u) % m * k + i, (owner(rank),),
                                            (owner((n - u) % m * k + i),)) for u in range(1, m)), False)
        # this node's block first on every rank (its own, ready at once), then the others' in node order from
        # it: the ranks then wait alike on what crossed between the nodes
        nodes = [(n + d) % m for d in range(m)]
        within = Phase(tuple(self._exchange(rank, n * k + (i + v) % k, n * k + (i - v) % k,
                                            tuple(owner(q * k + i) for q in nodes),
                                            tuple(owner(q * k + (i - v) % k) for q in nodes))
                             for v in range(1, k)), False)
        return tuple(p for p in (across, within) if p.exchanges)

    # ---- all-reduce: a reduce-scatter, then an all-gather of the summed blocks ----------------------------
    def owner(self, rank: int) -> int:
        """The block whose sum rank ``rank`` holds after the reduce-scatter."""
        if self.algorithm == "ring":
            return (rank + 1) % self.ranks
        if self.algorithm == "direct":
            return rank
        n, i = divmod(rank, self.per_node)
        return i * self.nodes + n

    def reduce_scatter(self, rank: int) -> tuple:
        """The phases of a reduce-scatter: each rank sends partial sums' blocks, receives its peers' partial
        sums of the blocks it will own into the output (as scratch) and adds them into its own."""
        t, own = self.ranks, self.owner
        if self.algorithm == "ring":
            return (Phase(tuple(self._exchange(rank, rank + 1, rank - 1, (rank - s + 1,), (rank - s,), (rank - s,))
                                for s in range(1, t)), True),)
        if self.algorithm == "direct":
            return (Phase(tuple(self._exchange(rank, rank + s, rank - s, (own((rank + s) % t),),
                                               (own((rank - s) % t),), (own(rank),)) for s in range(1, t)), True),)
        k, m = self.per_node, self.nodes
        n, i = divmod(rank, k)
        # within the node: position i gathers every node's blocks of its position (q·k + i, for each node q)
        nodes = [(n + d) % m for d in range(m)]
        within = Phase(tuple(self._exchange(rank, n * k + (i + v) % k, n * k + (i - v) % k,
                                            tuple(own(q * k + (i + v) % k) for q in nodes),
                                            tuple(own(q * k + (i - v) % k) for q in nodes),
                                            tuple(own(q * k + i) for q in nodes)) for v in range(1, k)), True)
        across = Phase(tuple(self._exchange(rank, (n + u) % m * k + i, (n - u) % m * k + i,
                                            (own((n + u) % m * k + i),), (own((n - u) % m * k + i),), (own(rank),))
                             for u in range(1, m)), True)
        return tuple(p for p in (within, across) if p.exchanges)

    def all_reduce(self, rank: int) -> tuple:
        """``(reduce-scatter phases, the block this rank then holds, all-gather phases)``."""
        return self.reduce_scatter(rank), self.owner(rank), self.gather(rank, self.owner)

    # ---- all-to-all: rank r's block j goes to rank j, where it lands as block r ----------------------------
    def all_to_all(self, rank: int) -> tuple:
        """The phases of an all-to-all (a mixture of experts' dispatch and combine: each chip's rows for every
        other chip's experts, and their results back): on a fully connected group every chip sends each peer
        its block at once over their own links, one hop, as the direct all-gather does (the blocks differ
        by destination).

        Raises
        ------
        CollectiveError
            On a group that is not all linked: a grid's or a ring's all-to-all forwards blocks through other
            chips, and is not built.
        """
        if self.algorithm != "direct":
            raise CollectiveError(f"an all-to-all of {self.ranks} chips of {self.system.name!r} would be "
                                  f"{self.algorithm}; only a fully connected group's (direct) is built")
        t = self.ranks
        return (Phase(tuple(self._exchange(rank, rank + s, rank - s, ((rank + s) % t,), ((rank - s) % t,))
                            for s in range(1, t)), False),)

    # ---- one-shot all-reduce: every chip sends its whole partial sums to every peer and adds them all -------
    def one_shot(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` is quicker sent whole to every peer and summed on every chip (one
        hop a level: a node, then across the nodes) than as a reduce-scatter and an all-gather (two hops a
        level, a T-th of the bytes each): a decode step's hidden state is, a prefill's is not. A ring never
        is (its chips are not all linked)."""
        if self.algorithm == "ring" or self.ranks == 1:
            return False
        rate, hop = self.system.chip.c2c_bytes_per_cycle, self.system.hop_cycles
        levels = [len(stage[0][1]) for stage in self.one_shot_stages(0)]  # links a pair, each level
        if len(levels) == 1:
            whole = hop + ceil(nbytes / (levels[0] * rate))
        else:  # half the bytes each way round, side by side: at each level the kind with fewer links binds
            whole = len(levels) * (hop + ceil(nbytes / len(levels) / (min(levels) * rate)))
        scattered = sum(2 * (hop + ceil(nbytes / self.ranks / (links * rate))) for links in levels)
        return whole < scattered

    def one_shot_stages(self, rank: int) -> tuple:
        """Per level, this rank's ``(to, its ports, from, its ports)`` for every peer it exchanges with: the
        group (direct), or the node and then the same position in every other node (hierarchical)."""
        def pair(s, peers):
            to, frm = peers(s), peers(-s)
            return (self.chips[to], self._ports(rank, to), self.chips[frm], self._ports(rank, frm))
        if self.algorithm == "direct":
            return (tuple(pair(s, lambda d: (rank + d) % self.ranks) for s in range(1, self.ranks)),)
        k, m = self.per_node, self.nodes
        n, i = divmod(rank, k)
        within = tuple(pair(v, lambda d: n * k + (i + d) % k) for v in range(1, k))
        across = tuple(pair(u, lambda d: (n + d) % m * k + i) for u in range(1, m))
        return tuple(level for level in (within, across) if level)

    def tags(self) -> int:
        """Tags one all-reduce uses (an all-gather fewer): one a piece of every exchange of every phase."""
        return 4 * self.ranks * max(self.ranks, self.links)

    @property
    def links(self) -> int:
        """Links between two chips of the group (the most of any pair one exchange uses)."""
        return max((len(self._ports(0, r)) for r in range(1, self.ranks)), default=1)


def choose(system: SystemConfig, count: int) -> Group:
    """The ``count`` chips of ``system`` a collective runs on, and its algorithm (see the module docstring).

    Raises
    ------
    CollectiveError
        When no ring, node or grid of ``count`` chips exists.
    """
    if count == 1:
        return Group("direct", (0,), system)
    if count > system.chips:
        raise CollectiveError(f"system {system.name!r} has {system.chips} chips, not {count}")
    # a fully connected group: the first chips of a node, or of a fully connected system
    first = tuple(range(count))
    if all(system.links_between(a, b) for a in first for b in first if a < b):
        return Group("direct", first, system)
    node = _node_size(system)
    if node and count % node == 0 and count // node <= system.chips // node:
        nodes = count // node
        chips = tuple(q * node + p for q in range(nodes) for p in range(node))
        if all(system.links_between(chips[0], c) for c in chips[1:node]) and \
                all(system.links_between(q * node, r * node) for q in range(nodes) for r in range(q + 1, nodes)):
            group = Group("hierarchical", chips, system, nodes)
            if _grid_linked(group):
                return group
    order = _ring_order(system, count)
    if order is None:
        raise CollectiveError(f"system {system.name!r}: no ring, node or grid of {count} chips to run a "
                              f"collective on")
    return Group("ring", tuple(order), system)


def _node_size(system: SystemConfig) -> int:
    """The chips of a node: the size of the fully connected block that chip 0 belongs to."""
    if not system.links:
        return 0
    mates = [0] + [c for c in range(1, system.chips) if system.links_between(0, c)]
    size = 1
    while size < len(mates) and mates[size] == size and all(system.links_between(size, c) for c in range(1, size)):
        size += 1
    return size if size > 1 else 0


def _grid_linked(group: Group) -> bool:
    k, m, chips = group.per_node, group.nodes, group.chips
    system = group.system
    within = all(system.links_between(chips[q * k + a], chips[q * k + b])
                 for q in range(m) for a in range(k) for b in range(a + 1, k))
    across = all(system.links_between(chips[q * k + p], chips[r * k + p])
                 for p in range(k) for q in range(m) for r in range(q + 1, m))
    return within and across


def _ring_order(system: SystemConfig, count: int):
    """``count`` chips each linked to the next and the last to the first (a walk from chip 0), or None."""
    order, seen = [0], {0}
    while len(order) < count:
        nxt = next((c for c in system.neighbours(order[-1]) if c not in seen), None)
        if nxt is None:
            return None
        order.append(nxt)
        seen.add(nxt)
    if count > 2 and not system.links_between(order[-1], order[0]):
        return None
    return order
