"""A system program (one LPX program per chip) and the system simulator that runs it in one global time.

Every chip's program is checked against its chip as before (its C2C ports are
units like any other). Then the network: every SEND is matched by the RECV
with its tag on the chip it names, along the route the system gives:

- ``unmatched SEND`` / ``unmatched RECV``: a transfer has one end only;
- ``wrong destination``: the RECV for a SEND waits on another chip;
- ``wrong link``: a transfer leaves, or lands, on a port that is not its route's;
- ``transfer size``: the two ends disagree on the bytes;
- ``RECV before arrival`` / ``RECV after arrival``: the first byte arrives at the
  SEND's cycle plus one hop latency per hop, and the RECV must take it exactly
  then (the network has no buffers and no back-pressure);
- ``link conflict``: one link direction carries one transfer at a time; a transfer
  holds each link of its route for its bytes ÷ the link rate, one hop later on
  each (the chips along the way forward it).

Each violation names the chips, the link and the cycle. Running the program
interleaves every chip's instructions by cycle; a SEND's data reaches its RECV's
SRAM through the simulator, as it would through the link.

Layout (little endian)::

    header  magic b"LPXSYS\\0\\0" | u16 version | u16 reserved | u64 body length | 16-byte blake2b
    body    u32 length of a JSON table (system, chips, host inputs and outputs, predicted cycles,
            program lengths) | the table | each chip's encoded program, in order, each at a multiple of 64
            bytes (zeros before it)

The system's blake2b (format 3) is of the blake2b of each 64 MiB of the body in turn (:func:`.container.tree_digest`):
the pieces are hashed on two cores at once, and the chips' programs are written side by side too (format 2
hashed the body in one stream: a 1 B model's 2 GB of weights on one core at each encoding and each load).
"""

from __future__ import annotations

import heapq
import json
import struct
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .check import ScheduleError
from .container import HEADER, opened, tree_digest
from .isa import HostTensor, Opcode
from .program import _ALIGN, SYSTEM_MAGIC, Encoding, Program, ProgramFormatError, aligned_array, decoded_columns
from .simulator import CallError, Simulator
from .stats import Timed
from .system import SystemConfig, load_system

SYSTEM_VERSION = 3
_CHIP_WORKERS = 2  # chips' programs written at once (copying and hashing let go of the GIL)


class NetworkError(ScheduleError):
    """A system program breaks a rule of the chip-to-chip network."""

    def __init__(self, rule: str, chip: int, index: int, cycle: int, detail: str):
        self.chip = chip
        super().__init__(rule, index, cycle, f"chip {chip}: {detail}")


@dataclass(frozen=True)
class SystemProgram:
    """One program per chip of a system, and where the model's host inputs and outputs go.

    ``inputs[k]`` lists the ``(chip, index in that chip's program)`` pairs that load the model's k-th input
    (several chips may need it), or ``(chip, index, axis, lo, hi)`` where a chip takes only the slice
    ``[lo, hi)`` of it along ``axis`` (tensor parallel: a decoder's KV cache, each chip its heads');
    ``outputs[k]`` lists where the model's k-th output is stored: one ``(chip, index)`` pair, or the
    ``(chip, index, axis, lo, hi)`` of each chip that stores its slice (a pair given alone is read as a list
    of one); ``chips[p]`` is the system chip that runs ``programs[p]``.
    """

    system_name: str
    system_digest: bytes
    chips: tuple
    programs: tuple
    inputs: tuple
    outputs: tuple
    predicted_cycles: int
    parallel: str = ""
    notes: str = ""

    def __post_init__(self):
        # (format 1 named one (chip, index) pair per output: read as a list of one)
        outputs = tuple((tuple(x),) if x and isinstance(x[0], int) else tuple(tuple(d) for d in x)
                        for x in self.outputs)
        object.__setattr__(self, "outputs", outputs)

    def program_of(self, chip: int) -> Program:
        return self.programs[self.chips.index(chip)]

    def encoded(self) -> np.ndarray:
        """The system program as the runtime takes it (see :func:`encode_system`)."""
        return encode_system(self)


def is_system_program(blob) -> bool:
    return bytes(memoryview(blob).cast("B")[:8]) == SYSTEM_MAGIC


def encode_system(program: SystemProgram) -> np.ndarray:
    """Serialize a system program into one 64-byte aligned uint8 array."""
    encodings = [Encoding(p) for p in program.programs]
    table = json.dumps({"system": program.system_name, "digest": program.system_digest.hex(),
                        "chips": list(program.chips), "inputs": [[list(d) for d in x] for x in program.inputs],
                        "outputs": [[list(d) for d in x] for x in program.outputs], "predicted": program.predicted_cycles,
                        "parallel": program.parallel, "notes": program.notes,
                        "lengths": [e.nbytes for e in encodings], "aligned": _ALIGN}).encode()
    # each chip's program starts at a multiple of 64 bytes (zeros before it), and so do its weights
    starts, at = [], HEADER.size + 4 + len(table)
    for encoding in encodings:
        at += -at % _ALIGN
        starts.append(at)
        at += encoding.nbytes
    out = aligned_array(at)
    view = memoryview(out).cast("B")
    struct.pack_into("<I", view, HEADER.size, len(table))
    view[HEADER.size + 4:HEADER.size + 4 + len(table)] = table
    end = HEADER.size + 4 + len(table)
    for encoding, start in zip(encodings, starts):
        view[end:start] = bytes(start - end)  # the padding: zeros (a gap, never the whole buffer, is written)
        end = start + encoding.nbytes
    with ThreadPoolExecutor(_CHIP_WORKERS, thread_name_prefix="lpx-encode") as pool:
        # each chip's program written, and sealed, in its place: no copy of its own
        list(pool.map(lambda job: job[0].write(view[job[1]:job[1] + job[0].nbytes]), zip(encodings, starts)))
    body = view[HEADER.size:]
    HEADER.pack_into(view, 0, SYSTEM_MAGIC, SYSTEM_VERSION, 0, len(body), tree_digest(body))
    return out


def decode_system(blob, system: SystemConfig | str | None = None) -> SystemProgram:
    """Parse and validate a system program (each chip's program fully, as :func:`decode` does)."""
    return _decoded_system(blob, system)[0]


def _decoded_system(blob, system) -> tuple:
    """:func:`decode_system`, with each chip's validated :class:`.columns.ProgramColumns` (what its
    simulator would otherwise validate again)."""
    # version 1: before inputs and outputs could be split; 2: before the checksum went by pieces
    version, body, digest = opened(blob, SYSTEM_MAGIC, (1, 2, SYSTEM_VERSION), "system program",
                                   verified=True)
    if version < 3:
        opened(blob, SYSTEM_MAGIC, (version,), "system program")  # the checksum in one stream
    elif tree_digest(body) != bytes(digest):
        raise ProgramFormatError("system program checksum mismatch: the bytes were corrupted")
    try:
        (n,) = struct.unpack_from("<I", body, 0)
        table = json.loads(bytes(body[4:4 + n]))
        name, system_digest = table["system"], bytes.fromhex(table["digest"])
        lengths = [int(length) for length in table["lengths"]]
    except (ValueError, KeyError, TypeError, struct.error) as err:
        raise ProgramFormatError(f"malformed system program: {err}") from None
    config = load_system(system if system is not None else name)
    _check_made_for(config, name, system_digest)  # before any chip program is decoded
    chips, at, align = [], 4 + n, int(table.get("aligned", 1))
    for length in lengths:
        pad = -(HEADER.size + at) % align
        if any(body[at:at + pad]):
            raise ProgramFormatError("system program's padding before a chip's program is not zeros")
        at += pad
        chips.append((at, length))
        at += length
    # each chip's program validated against the system's chip; the system's checksum covers its bytes
    columns = [decoded_columns(body[start:start + length], config.chip, verified=True) for start, length in chips]
    try:
        program = SystemProgram(name, system_digest, tuple(table["chips"]),
                                tuple(c.program for c in columns),
                                tuple(tuple(tuple(d) for d in x) for x in table["inputs"]),
                                tuple(table["outputs"]), int(table["predicted"]),
                                table.get("parallel", ""), table.get("notes", ""))
    except (ValueError, KeyError, TypeError) as err:
        raise ProgramFormatError(f"malformed system program: {err}") from None
    _check_placement(program, config)
    return program, columns


def _check_made_for(system: SystemConfig, name: str, digest: bytes) -> None:
    if digest != system.digest:
        raise ProgramFormatError(f"system program was made for another {name!r} "
                                 f"(digests {bytes(digest).hex()} vs {system.digest.hex()})")


def _check_placement(program: SystemProgram, system: SystemConfig) -> None:
    """A program per chip, each on its own chip of ``system``."""
    chips, programs = program.chips, program.programs
    if not isinstance(programs, tuple) or not all(isinstance(p, Program) for p in programs):
        raise ProgramFormatError(f"system program: its programs must be a tuple of Program, got "
                                 f"{type(programs).__name__}" + (" of others" if isinstance(programs, tuple) else ""))
    if not isinstance(chips, tuple) or len(chips) != len(programs):
        raise ProgramFormatError(f"system program: {len(programs)} programs for the chips {chips!r} (one a chip)")
    if len(set(chips)) != len(chips) or not all(type(c) is int and 0 <= c < system.chips for c in chips):
        raise ProgramFormatError(f"system program: its chips {list(chips)} must be distinct chips of "
                                 f"{system.name!r} (0..{system.chips - 1})")


def check_network(system: SystemConfig, program: SystemProgram, timelines: list) -> dict:
    """Check every transfer (see the module docstring); return bytes and busy cycles per link direction.

    Raises
    ------
    NetworkError
        Naming the rule, the chips, the link and the cycle.
    """
    hop = system.hop_cycles
    sends, recvs = {}, {}
    for chip, prog, timeline in zip(program.chips, program.programs, timelines):
        for index, ins in enumerate(prog.instructions):
            if ins.opcode not in (Opcode.SEND, Opcode.RECV):
                continue
            ref = (ins.srcs or ins.dsts)[0]
            entry = (chip, index, ins.cycle, ins.unit_index, ref.nbytes, timeline.occupancies[index].busy)
            table, key = (sends, (chip, ins.attrs["peer"], ins.attrs["tag"])) if ins.opcode == Opcode.SEND \
                else (recvs, (ins.attrs["peer"], chip, ins.attrs["tag"]))
            if key in table:
                raise NetworkError("duplicate tag", chip, index, ins.cycle,
                                   f"a second {ins.opcode.name} tagged {key[2]} between chips {key[0]} and {key[1]}")
            table[key] = entry
    windows = defaultdict(list)  # (from chip, port) -> [(start, end, chip of the SEND, its index)]
    for (src, dst, tag), (chip, index, cycle, port, nbytes, busy) in sorted(sends.items()):
        recv = recvs.pop((src, dst, tag), None)
        if recv is None:
            elsewhere = [k for k in recvs if k[0] == src and k[2] == tag]
            if elsewhere:
                raise NetworkError("wrong destination", chip, index, cycle,
                                   f"SEND tagged {tag} goes to chip {dst}, but its RECV waits on chip {elsewhere[0][1]}")
            raise NetworkError("unmatched SEND", chip, index, cycle, f"SEND tagged {tag} to chip {dst} has no RECV")
        r_chip, r_index, r_cycle, r_port, r_bytes, _ = recv
        if r_bytes != nbytes:
            raise NetworkError("transfer size", r_chip, r_index, r_cycle,
                               f"RECV tagged {tag} takes {r_bytes} bytes, chip {src} sends {nbytes}")
        try:
            # a transfer to a neighbour takes the link its port names (several may join the pair); any other
            # the shortest route
            direct = system.ports(src).get(port)
            route = ((src, port, dst, direct[1]),) if direct and direct[0] == dst else system.route(src, dst)
        except ValueError as err:
            raise NetworkError("wrong destination", chip, index, cycle, str(err)) from None
        if not route:
            raise NetworkError("wrong destination", chip, index, cycle, "a chip sends to itself")
        if route[0][1] != port:
            raise NetworkError("wrong link", chip, index, cycle, f"SEND to chip {dst} leaves on port {port}; the "
                               f"route's first link is port {route[0][1]} (to chip {route[0][2]})")
        if route[-1][3] != r_port:
            raise NetworkError("wrong link", r_chip, r_index, r_cycle, f"RECV from chip {src} listens on port "
                               f"{r_port}; the route arrives on port {route[-1][3]} (from chip {route[-1][0]})")
        arrival = cycle + len(route) * hop
        if r_cycle != arrival:
            rule = "RECV before arrival" if r_cycle < arrival else "RECV after arrival"
            raise NetworkError(rule, r_chip, r_index, r_cycle,
                               f"the data chip {src} sends at cycle {cycle} arrives at cycle {arrival} "
                               f"({len(route)} hop(s) of {hop} cycles); the RECV issues at {r_cycle}"
                               + (" and nothing holds the data until then" if r_cycle > arrival else ""))
        for k, (u, u_port, _, _) in enumerate(route):
            windows[(u, u_port)].append((cycle + k * hop, cycle + k * hop + busy, chip, index, nbytes))
    if recvs:
        (src, dst, tag), (chip, index, cycle, *_) = next(iter(sorted(recvs.items())))
        raise NetworkError("unmatched RECV", chip, index, cycle, f"RECV tagged {tag} from chip {src}: nothing sent")
    usage = {}
    for (u, port), spans in windows.items():
        spans.sort()
        for (s0, e0, c0, i0, _), (s1, e1, c1, i1, _) in zip(spans, spans[1:]):
            if s1 < e0:
                peer = system.ports(u)[port][0]
                raise NetworkError("link conflict", c1, i1, s1,
                                   f"the link from chip {u} (port {port}) to chip {peer} carries chip {c0}'s "
                                   f"transfer (instruction {i0}) until cycle {e0}")
        usage[(u, port)] = {"bytes": sum(s[4] for s in spans), "busy_cycles": sum(e - s for s, e, *_ in spans),
                            "transfers": len(spans)}
    return usage


@dataclass
class SystemStats(Timed):
    """Cycle-level figures of a system program: global makespan, each chip's, and each link direction's."""

    cycles: int
    predicted_cycles: int
    clock_hz: int
    chips: dict  # system chip -> RunStats
    links: dict  # (chip, port) -> {"bytes", "busy_cycles", "transfers", "peer"}

    def to_dict(self) -> dict:
        return {"cycles": self.cycles, "predicted_cycles": self.predicted_cycles, "microseconds": self.microseconds,
                "chips": {str(c): {"cycles": s.cycles, "mac_utilisation": s.mac_utilisation,
                                   "units": {u: s.utilisation[u] for u in s.unit_busy}} for c, s in self.chips.items()},
                "links": [{"from": c, "port": p, **v} for (c, p), v in sorted(self.links.items())]}


class SystemSimulator:
    """Runs a system program: every chip's program checked, the network checked, all in one global time.

    Parameters
    ----------
    program : SystemProgram or bytes-like
    system : SystemConfig or str, optional
        By default the system the program names.
    check_schedule : bool
        Verify every chip's schedule and the network at load (default).
    timing_only : bool
        Verify and measure, but set up no arithmetic (see :class:`Simulator`).
    """

    def __init__(self, program, system=None, check_schedule: bool = True, timing_only: bool = False):
        if isinstance(program, SystemProgram):
            self.system = load_system(system if system is not None else program.system_name)
            _check_made_for(self.system, program.system_name, program.system_digest)
            _check_placement(program, self.system)
            chip_programs = program.programs
        else:
            program, chip_programs = _decoded_system(program, system)  # validated: their columns
            self.system = load_system(system if system is not None else program.system_name)
        self.program = program
        self.sims = [Simulator(p, self.system.chip, check_schedule=check_schedule, timing_only=timing_only)
                     for p in chip_programs]
        usage = check_network(self.system, program, [s.timeline for s in self.sims])
        makespan = max((s.stats.cycles for s in self.sims), default=0)
        if check_schedule and makespan != program.predicted_cycles:
            raise ScheduleError("predicted cycles", 0, makespan, f"the system program predicts "
                                f"{program.predicted_cycles} cycles, its chips take {makespan}")
        links = {key: {**value, "peer": self.system.ports(key[0])[key[1]][0]} for key, value in usage.items()}
        self.stats = SystemStats(makespan, program.predicted_cycles, self.system.chip.clock_hz,
                                 {c: s.stats for c, s in zip(program.chips, self.sims)}, links)
        self._inputs = _host_tensors(program, program.inputs, self.sims, "inputs", "input")
        self._outputs = _host_tensors(program, program.outputs, self.sims, "outputs", "output")
        self.timing_only = timing_only
        if timing_only:
            return
        # the schedule is static: every chip's instructions in one global issue order, worked out once
        self._steps = list(heapq.merge(*[[(sim.program.instructions[i].cycle, k, pos)
                                          for pos, i in enumerate(sim.order)] for k, sim in enumerate(self.sims)]))
        self._chip_index = {c: k for k, c in enumerate(program.chips)}
        given = {(self._chip_index[d[0]], d[1]) for destinations in program.inputs for d in destinations}
        # a chip input the model does not give is a state the runtime set (or data a RECV brings): never LOADed,
        # so one placeholder serves every call
        self._placeholders = {(k, i): np.zeros(sig.shape, sig.dtype.np) for k, sim in enumerate(self.sims)
                              for i, sig in enumerate(sim.inputs) if (k, i) not in given}

    @property
    def chips(self) -> tuple:
        """``(system chip, its simulator)`` for every chip the program runs on."""
        return tuple(zip(self.program.chips, self.sims))

    @property
    def chip_config(self):
        return self.system.chip

    @property
    def notes(self) -> str:
        return self.program.notes

    @property
    def links(self) -> dict:
        return self.stats.links

    def destinations(self, index: int) -> tuple:
        """Where host input ``index`` goes (see :class:`SystemProgram`'s ``inputs``)."""
        return self.program.inputs[index]

    @property
    def inputs(self) -> tuple:
        return self._inputs

    @property
    def outputs(self) -> tuple:
        return self._outputs

    def run(self, inputs, outputs=None) -> list:
        """Run every chip's program, interleaved by cycle; returns the model's outputs."""
        if self.timing_only:
            raise CallError("a timing-only simulator measures cycles and runs no arithmetic")
        if len(inputs) != len(self.program.inputs):
            raise CallError(f"system program takes {len(self.program.inputs)} inputs, got {len(inputs)}")
        where = self._chip_index
        per_in = [[self._placeholders.get((k, i)) for i in range(len(s.inputs))] for k, s in enumerate(self.sims)]
        for value, destinations in zip(inputs, self.program.inputs):
            for chip, index, *cut in destinations:
                per_in[where[chip]][index] = np.asarray(value)[axis_slice(*cut)] if cut else value
        sessions = [sim.session(per_in[k]) for k, sim in enumerate(self.sims)]
        mailbox = {}
        for _, k, pos in self._steps:
            sim = self.sims[k]
            fn, op, outs, ins, attrs = sim.bound(pos)
            if op == Opcode.SEND:
                mailbox[(self.program.chips[k], attrs["peer"], attrs["tag"])] = np.array(ins[0])
            elif op == Opcode.RECV:
                data = mailbox.pop((attrs["peer"], self.program.chips[k], attrs["tag"]))
                np.copyto(outs[0], data.reshape(outs[0].shape))
            else:
                sessions[k].step(pos)
        results = [session.finish() for session in sessions]
        out = []
        for sig, parts in zip(self._outputs, self.program.outputs):
            if len(parts) == 1 and len(parts[0]) == 2:
                out.append(results[where[parts[0][0]]][parts[0][1]])
                continue
            whole = np.empty(sig.shape, sig.dtype.np)  # each chip stored its slice
            for chip, index, *cut in parts:
                whole[axis_slice(*cut)] = results[where[chip]][index]
            out.append(whole)
        if outputs is not None:
            for buffer, value in zip(outputs, out):
                np.copyto(buffer, value)
            return list(outputs)
        return out


def axis_slice(axis: int, lo: int, hi: int) -> tuple:
    """The index of the slice ``[lo, hi)`` along ``axis`` (every axis before it whole)."""
    return (slice(None),) * axis + (slice(lo, hi),)


def _host_tensors(program: SystemProgram, table: tuple, sims: list, attr: str, what: str) -> tuple:
    """Each model input's (or output's) host signature, from the chips that load (store) it. A map that names
    no such chip or tensor, mixes whole and sliced copies, stores a whole output twice, or whose slices do
    not tile the tensor is rejected here, naming what is wrong."""
    out = []
    for k, destinations in enumerate(table):
        parts = []
        for d in destinations:
            if len(d) not in (2, 5) or d[0] not in program.chips:
                raise ProgramFormatError(f"system program: {what} {k} goes to {list(d)}, not (chip, index) or "
                                         "(chip, index, axis, lo, hi) of one of its chips")
            chip_tensors = getattr(sims[program.chips.index(d[0])], attr)
            if not 0 <= d[1] < len(chip_tensors):
                raise ProgramFormatError(f"system program: {what} {k} is {what} {d[1]} of chip {d[0]}, "
                                         f"which has {len(chip_tensors)}")
            parts.append((chip_tensors[d[1]], tuple(d[2:]), d))
        if not parts:
            raise ProgramFormatError(f"system program: {what} {k} is on no chip")
        whole = [sig for sig, cut, _ in parts if not cut]
        if whole:
            if len(whole) < len(parts) or (what == "output" and len(whole) > 1) or any(w != whole[0] for w in whole):
                raise ProgramFormatError(f"system program: {what} {k} is on chips {[list(d) for _, _, d in parts]}: "
                                         f"one whole {what}, or the same one on every chip, or slices of it")
            out.append(whole[0])
            continue
        first, (axis, _, _), _ = parts[0]
        if not 0 <= axis < len(first.shape):
            raise ProgramFormatError(f"system program: {what} {k} is split along axis {axis} of {list(first.shape)}")
        for sig, (ax, lo, hi), d in parts:
            same_elsewhere = sig.shape[:axis] + sig.shape[axis + 1:] == first.shape[:axis] + first.shape[axis + 1:]
            if ax != axis or sig.shape[axis] != hi - lo or not same_elsewhere or sig.dtype != first.dtype:
                raise ProgramFormatError(f"system program: chip {d[0]}'s slice {list(d)} of {what} {k} is "
                                         f"{sig.dtype.short}{list(sig.shape)}, not [{lo}, {hi}) along axis {axis} "
                                         f"of what the other chips hold")
        spans = sorted((lo, hi) for _, (_, lo, hi), _ in parts)
        if spans[0][0] != 0 or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise ProgramFormatError(f"system program: the slices of {what} {k} do not tile it along axis "
                                     f"{axis}: {spans}")
        full = list(first.shape)
        full[axis] = spans[-1][1]
        out.append(HostTensor(tuple(full), first.dtype))
    return tuple(out)
