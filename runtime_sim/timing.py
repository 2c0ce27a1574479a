"""The machine's timing rules: what one instruction occupies, and for how long. One rule per group.

Every instruction occupies, from its issue cycle for ``busy`` cycles:

- its unit instance (a matrix plane's array or its weight-load port, a vector
  queue, a switch unit, a DMA engine) and, for host transfers, the one host link;
- some of the chip's streams (each moves one 320-byte vector per cycle), its
  share of SRAM read and write bandwidth (every slice reads one vector and writes
  one per cycle), and for vector work some of the ALUs of each lane.

Its results have fully arrived ``latency`` cycles after that (the unit's
pipeline and the stream hops). The rates come from the chip preset, whose every
figure names its public source or says it is assumed. The simulator checks a
program against these rules at each stated issue cycle; the compiler plans with
the same rules. Cycle counts in the tests are worked out by hand from the preset,
never by calling this module.
"""

from __future__ import annotations

from math import ceil, prod
from typing import NamedTuple

from .config import ChipConfig
from .isa import OP_TABLE, Group, Instruction, Opcode, Space, Unit


class Occupancy(NamedTuple):
    """What an instruction holds while it runs, and what it achieves.

    ``exclusive`` lists the resources it holds alone for ``busy`` cycles; the
    rates (``streams``, ``sram_read``, ``sram_write`` in bytes per cycle, ``alus``
    per lane) are shared with whatever else runs in those cycles. (A named
    tuple: the scheduler and the checker make one per instruction, and a tuple
    is made several times faster than a frozen dataclass.)
    """

    exclusive: tuple
    busy: int
    latency: int
    streams: int = 0
    sram_read: int = 0
    sram_write: int = 0
    alus: int = 0
    macs: int = 0
    flops: int = 0
    sram_bytes: int = 0
    host_bytes: int = 0
    bound: str = "latency"

    @property
    def finish(self) -> int:
        """Cycles from issue until the results have fully arrived."""
        return self.busy + self.latency


def _sram_rates(ins: Instruction, busy: int) -> tuple:
    read = sum(r.nbytes for r in ins.srcs if r.in_sram)
    write = sum(r.nbytes for r in ins.dsts if r.in_sram)
    span = max(busy, 1)
    return ceil(read / span), ceil(write / span), read + write


def _traffic(ins: Instruction) -> int:
    """Bytes the instruction puts on streams: SRAM operands both ways, and the chained results it produces.
    A chained operand it consumes is on the stream its producer already counted."""
    return sum(r.nbytes for r in ins.srcs if r.in_sram) + sum(r.nbytes for r in ins.dsts)


def _streams_for(nbytes: int, busy: int, config: ChipConfig) -> int:
    """Streams a transfer of ``nbytes`` spread over ``busy`` cycles needs (one vector per stream per cycle)."""
    return ceil(nbytes / (max(busy, 1) * config.lanes)) if nbytes else 0


def _host(ins, config):
    ref = (ins.dsts or ins.srcs)[0]
    busy = ceil(ref.nbytes / config.host_bytes_per_cycle)
    read, write, moved = _sram_rates(ins, busy)
    return Occupancy((("MEM", ins.unit_index), ("HOST", 0)), busy, config.latency_cycles["MEM"], 1, read, write,
                     sram_bytes=moved, host_bytes=ref.nbytes, bound="host")


def _control(ins, config):
    return Occupancy((("ICU", ins.unit_index),), ins.attrs["cycles"], config.latency_cycles["ICU"])


def _install(ins, config):
    tile = ins.srcs[0]
    streams = config.mxm_install_streams
    busy = ceil(tile.nbytes / (streams * config.lanes))
    read, write, moved = _sram_rates(ins, busy)
    # the tile is in the buffer when its last vector has crossed from the memory slices to the plane
    return Occupancy((("MXM.load", ins.unit_index),), busy, config.stream_hops, streams, read, write,
                     sram_bytes=moved, bound="install")


def _matrix(ins, config):
    """One activation row (a vector of K ≤ the array's rows) enters per pass; fp16 and fp32 take several."""
    a, out = ins.srcs[0], ins.dsts[0]
    rows = prod(a.shape[:-1])
    busy = rows * config.mxm_passes[a.dtype.matrix_class]
    read, write, moved = _sram_rates(ins, busy)
    traffic = _traffic(ins)
    macs = rows * a.shape[-1] * out.shape[-1]
    return Occupancy((("MXM", ins.unit_index),), busy, config.latency_cycles["MXM"],
                     _streams_for(traffic, busy, config), read, write, macs=macs, flops=2 * macs,
                     sram_bytes=moved, bound="matrix")


def _alu_ops(ins) -> int:
    group = ins.spec.group
    if group in (Group.WINDOW, Group.DEPTHWISE):
        kh, kw = ins.attrs["kernel"]
        taps = kh * kw * (2 if group == Group.DEPTHWISE else 1)  # a multiply and an add per depthwise tap
        if group == Group.WINDOW:
            return taps
        # its epilogue, and for an integer result the requantising step an int8 EPILOGUE has (assumed)
        return taps + OP_TABLE[Opcode.EPILOGUE].alu_ops + (1 if ins.dsts[0].dtype.is_quantized else 0)
    if group == Group.EPILOGUE and (ins.dsts[0].dtype.is_quantized or len(ins.srcs) == 3):
        return ins.spec.alu_ops + 1  # a rounding multiply, the zero point, a saturating convert (assumed)
    return max(ins.spec.alu_ops, 1)


def _vector(ins, config):
    """Vectors of 320 elements flow through a chain of ALUs; the rate is bound by ALUs or by streams.

    ``r`` vectors per cycle need ``r · alu_ops`` of a lane's ALUs and the
    streams to carry ``r`` vectors of every operand, at most one direction's
    worth. A vector needing more ALUs than a lane has, or more streams than a
    direction has, takes several cycles.
    """
    reduce_like = ins.spec.group == Group.REDUCE
    elements = (ins.srcs[0] if reduce_like else ins.dsts[0]).size
    vectors = max(ceil(elements / config.lanes), 1)
    alu_ops = _alu_ops(ins)
    alus = config.vxm_alus_per_lane
    traffic = _traffic(ins)
    per_vector_streams = traffic / (vectors * config.lanes)
    by_alus = max(alus // alu_ops, 1)
    by_streams = max(int(config.streams_per_direction // max(per_vector_streams, 1e-9)), 1)
    rate = min(by_alus, by_streams)
    # a vector needing more ALU operations, or more streams, than a lane or a direction has takes several cycles
    cycles_per_step = max(ceil(alu_ops / alus), ceil(per_vector_streams / config.streams_per_direction), 1)
    busy = ceil(vectors / rate) * cycles_per_step
    read, write, moved = _sram_rates(ins, busy)
    return Occupancy((("VXM", ins.unit_index),), busy, config.latency_cycles["VXM"],
                     _streams_for(traffic, busy, config), read, write, alus=min(alus, rate * alu_ops),
                     flops=elements * alu_ops, sram_bytes=moved, bound="vector" if by_alus <= by_streams else "streams")


def _switch(ins, config):
    """The switch moves vectors between streams: in and out, at its rate (the larger side sets the count)."""
    vectors = max(ceil(max(sum(r.nbytes for r in ins.srcs), ins.dsts[0].nbytes) / config.lanes), 1)
    rate = min(config.sxm_vectors_per_cycle, config.streams_per_direction // 2)
    busy = ceil(vectors / rate)
    read, write, moved = _sram_rates(ins, busy)
    traffic = _traffic(ins)
    return Occupancy((("SXM", ins.unit_index),), busy, config.latency_cycles["SXM"],
                     _streams_for(traffic, busy, config), read, write, sram_bytes=moved, bound="switch")


def _link(ins, config):
    """A transfer holds its port's send (or receive) side while its bytes cross the link at the link's rate;
    the first byte reaches the next chip one hop latency after the SEND issues (the system checks arrival)."""
    ref = (ins.srcs or ins.dsts)[0]
    busy = max(ceil(ref.nbytes / config.c2c_bytes_per_cycle), 1)
    read, write, moved = _sram_rates(ins, busy)
    # a SEND's bytes reach the next chip one hop later; a RECV's are in SRAM as its last byte lands
    sending = ins.opcode == Opcode.SEND
    return Occupancy(((("C2C.tx" if sending else "C2C.rx"), ins.unit_index),), busy,
                     config.latency_cycles["C2C"] if sending else 0, 1, read, write, sram_bytes=moved, bound="link")


RULES = {
    Group.LINK: _link, Group.HOST: _host, Group.CONTROL: _control, Group.INSTALL: _install, Group.MATRIX: _matrix,
    Group.EPILOGUE: _vector, Group.UNARY: _vector, Group.BINARY: _vector, Group.QBINARY: _vector,
    Group.QUANT: _vector, Group.REDUCE: _vector, Group.NORM: _vector, Group.WINDOW: _vector,
    Group.DEPTHWISE: _vector, Group.MOVE: _switch,
}
assert {spec.group for spec in OP_TABLE.values()} <= set(RULES), "every group needs a timing rule"
assert all(spec.unit != Unit.VXM or RULES[spec.group] is _vector for spec in OP_TABLE.values())


def occupancy(ins: Instruction, config: ChipConfig) -> Occupancy:
    """What ``ins`` occupies on ``config`` and for how long (see the module docstring)."""
    return RULES[ins.spec.group](ins, config)


_SHARED_RATES = ("streams", "sram_read", "sram_write", "alus")


def _shared_limits(config: ChipConfig) -> tuple:
    return (config.stream_capacity, config.sram_bytes_per_cycle, config.sram_bytes_per_cycle,
            config.vxm_alus_per_lane)


def chain_pace(members: list, config: ChipConfig) -> int:
    """The busy cycles of every member of a chain: instructions passing results along streams, which do not
    wait, so all of them run at one pace. It is the slowest member's, and no faster than what their combined
    demand of the shared resources allows: a chain of vector ops runs its ops on the lane's ALUs side by side,
    so ops needing 33 ALU operations an element between them pass ``16/33`` of a vector a cycle."""
    pace = max(occ.busy for occ in members)
    for name, limit in zip(_SHARED_RATES, _shared_limits(config)):
        pace = max(pace, ceil(sum(getattr(occ, name) * occ.busy for occ in members) / limit))
    return pace


def _apportioned(work: list, pace: int) -> list:
    """Whole per-cycle rates for work spread over ``pace`` cycles, summing to the least whole total that
    covers it (the largest remainders round up): the chain's members share what the chain needs."""
    floors = [w // pace for w in work]
    extra = -(-sum(work) // pace) - sum(floors)
    by_remainder = sorted(range(len(work)), key=lambda k: -(work[k] % pace))
    for k in by_remainder[:extra]:
        floors[k] += 1
    return floors


def paced(occupancies: list, links, config: ChipConfig) -> list:
    """``occupancies`` with the members of every chain stretched to the chain's pace (:func:`chain_pace`),
    their rates apportioned from what the chain needs together. ``links`` are ``(producer, consumer)`` index
    pairs, one per chained operand."""
    parent = {}

    def root(i):
        while parent.get(i, i) != i:
            parent[i] = parent.get(parent[i], parent[i])
            i = parent[i]
        return i
    for p, c in links:
        parent.setdefault(p, p)
        parent.setdefault(c, c)
        a, b = root(p), root(c)
        if a != b:
            parent[max(a, b)] = min(a, b)
    chains = {}
    for i in parent:
        chains.setdefault(root(i), []).append(i)
    out = list(occupancies)
    for members in chains.values():
        members.sort()
        occs = [occupancies[i] for i in members]
        pace = chain_pace(occs, config)
        rates = [_apportioned([getattr(o, name) * o.busy for o in occs], pace) for name in _SHARED_RATES]
        for k, i in enumerate(members):  # each runs over the pace, at its share of the chain's rates
            out[i] = occs[k]._replace(busy=pace, **{name: r[k] for name, r in zip(_SHARED_RATES, rates)})
    return out


def stream_links(instructions, order) -> list:
    """``(producer, consumer)`` pairs of a scheduled program: a consumer takes a stream's chain from the
    last instruction that started one on it (``order``: instruction indexes in issue order)."""
    last, links = {}, []
    for index in order:
        ins = instructions[index]
        for ref in ins.srcs:
            if ref.space == Space.STREAM and ref.addr in last:
                links.append((last[ref.addr], index))
        for ref in ins.dsts:
            if ref.space == Space.STREAM:
                last[ref.addr] = index
    return links


def makespan(instructions: list, config: ChipConfig) -> int:
    """Cycles until the last result of a scheduled program has arrived, its chains at their pace."""
    order = sorted(range(len(instructions)), key=lambda i: (instructions[i].cycle, i))
    occupancies = paced([occupancy(ins, config) for ins in instructions], stream_links(instructions, order), config)
    return max((ins.cycle + occ.finish for ins, occ in zip(instructions, occupancies)), default=0)


def on_instance(occ: Occupancy, unit_index: int) -> Occupancy:
    """``occ`` for the same instruction run by another instance of its unit: every rule lists the
    instruction's own unit instance first among what it holds alone, and nothing else depends on which."""
    (name, _), *rest = occ.exclusive
    return occ._replace(exclusive=((name, unit_index), *rest))
