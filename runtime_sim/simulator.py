"""The LPX simulator: verify a program's static schedule once, then run it fast.

Loading a program decodes and validates it, checks the schedule the way the
hardware relies on it, computes every cycle count, places the constants
(weights) in SRAM and binds each instruction to numpy views of its operands. The
schedule is static, so none of this depends on the data: each call then only
does the arithmetic.

Schedule rules (a program that breaks one is rejected with the instruction, the
cycle and the rule):

- ``unit overlap``: a unit instance runs one instruction at a time;
- ``RAW hazard``: an operand is read only after its producer has finished;
- ``WAR hazard``: a buffer is not overwritten while an earlier reader still reads it;
- ``WAW hazard``: two writes to the same bytes finish in issue order;
- ``SRAM overflow``: every operand lies inside SRAM.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .config import ChipConfig
from .cost import instruction_cost
from .hazards import AccessLog
from .isa import Opcode, Unit
from .program import Program, ProgramFormatError, decode, validate
from .semantics import SEMANTICS


class ScheduleError(ProgramFormatError):
    """A program breaks one of the hardware's static-schedule rules."""

    def __init__(self, rule: str, index: int, cycle: int, detail: str):
        self.rule, self.index, self.cycle = rule, index, cycle
        super().__init__(f"{rule}: instruction {index} at cycle {cycle}: {detail}")


class CallError(ValueError):
    """Inputs given to a program do not match its signature."""


@dataclass
class RunStats:
    """Cycle-level figures of a program (identical on every call: the schedule is static)."""

    cycles: int
    predicted_cycles: int
    clock_hz: int
    unit_busy: dict
    unit_instances: dict
    sram_high_water: int
    sram_bytes_moved: int
    host_bytes: int
    flops: int
    instruction_cycles_sum: int
    layers: list = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.cycles / self.clock_hz

    @property
    def utilisation(self) -> dict:
        """Busy fraction of each unit kind over the makespan (all its instances together)."""
        return {u: busy / (self.cycles * self.unit_instances[u]) if self.cycles else 0.0
                for u, busy in self.unit_busy.items()}

    def to_dict(self) -> dict:
        return {"predicted_cycles": self.predicted_cycles, "simulated_cycles": self.cycles,
                "seconds": self.seconds, "sram_high_water": self.sram_high_water,
                "sram_bytes_moved": self.sram_bytes_moved, "host_bytes": self.host_bytes, "flops": self.flops,
                "instruction_cycles_sum": self.instruction_cycles_sum,
                "units": {u: {"busy_cycles": b, "instances": self.unit_instances[u],
                              "utilisation": self.utilisation[u]} for u, b in self.unit_busy.items()},
                "layers": self.layers}


def _check_schedule(program: Program, costs: list, order: list) -> None:
    """Apply the schedule rules in issue order."""
    unit_free = {}
    log = AccessLog(sum(len(i.srcs) + len(i.dsts) for i in program.instructions))
    for index in order:
        ins = program.instructions[index]
        start = ins.cycle
        finish = start + costs[index].cycles
        key = (ins.unit, ins.unit_index)
        busy_until, previous = unit_free.get(key, (0, None))
        if start < busy_until:
            raise ScheduleError("unit overlap", index, start,
                                f"{ins.unit.name}{ins.unit_index} is busy until cycle {busy_until} "
                                f"with instruction {previous}")
        unit_free[key] = (finish, index)
        for ref in ins.srcs:
            if log.raw(ref) > start:
                raise ScheduleError("RAW hazard", index, start,
                                    f"reads {ref} before its producer finishes at cycle {log.raw(ref)}")
        for ref in ins.dsts:
            if log.war(ref) > start:
                raise ScheduleError("WAR hazard", index, start,
                                    f"overwrites {ref} while a reader reads it until cycle {log.war(ref)}")
            if log.raw(ref) > start:
                raise ScheduleError("WAW hazard", index, start,
                                    f"writes {ref} before an earlier write finishes at cycle {log.raw(ref)}")
        log.record(ins.srcs, ins.dsts, finish)


class Simulator:
    """Runs one LPX program: verified once at load, arithmetic only per call.

    Parameters
    ----------
    program : Program or bytes-like
        A decoded program, or its encoded bytes (decoded and validated here).
    config : ChipConfig or str, optional
        The chip; by default the preset the program names.
    check_schedule : bool
        Verify the static schedule at load (default). Turning it off changes
        nothing but the time spent loading.
    """

    def __init__(self, program, config: ChipConfig | str | None = None, check_schedule: bool = True):
        if not isinstance(program, Program):
            program = decode(program, config)  # validates too
        chip = validate(program, config)
        self.program, self.config = program, chip
        self.costs = [instruction_cost(ins, chip) for ins in program.instructions]
        self.order = sorted(range(len(program.instructions)), key=lambda i: program.instructions[i].cycle)
        if check_schedule:
            _check_schedule(program, self.costs, self.order)
        self.stats = self._stats()
        self._sram = np.zeros(chip.sram_bytes, np.uint8)
        for const in program.constants:
            self._sram[const.ref.addr:const.ref.end] = const.data
        self._bound = [self._bind(i) for i in self.order]
        self._lock = threading.Lock()

    def _view(self, ref):
        return self._sram[ref.addr:ref.end].view(ref.dtype.np).reshape(ref.shape)

    def _bind(self, index: int):
        ins = self.program.instructions[index]
        srcs = [self._view(r) for r in ins.srcs]
        if ins.opcode == Opcode.STREAM:  # host memory, bound once like everything else
            weight = self.program.streamed[ins.attrs["index"]]
            srcs = [weight.data.view(weight.host.dtype.np).reshape(weight.host.shape)]
        return (SEMANTICS[ins.opcode], ins.opcode, [self._view(r) for r in ins.dsts], srcs, ins.attrs)

    def _stats(self) -> RunStats:
        program, chip = self.program, self.config
        busy = {u.name: 0 for u in Unit}
        layers = defaultdict(lambda: {"cycles_busy": 0, "flops": 0, "bytes": 0, "start": None, "end": 0,
                                      "units": set(), "bound": defaultdict(int)})
        makespan = high_water = moved = host = flops = 0
        for ins, cost in zip(program.instructions, self.costs):
            busy[ins.unit.name] += cost.cycles
            makespan = max(makespan, ins.cycle + cost.cycles)
            for ref in ins.srcs + ins.dsts:
                high_water = max(high_water, ref.end)
            if ins.unit == Unit.MEM:
                host += cost.bytes
            else:
                moved += cost.bytes
            flops += cost.flops
            name = program.layer_names[ins.layer] if ins.layer < len(program.layer_names) else str(ins.layer)
            row = layers[name]
            row["cycles_busy"] += cost.cycles
            row["flops"] += cost.flops
            row["bytes"] += cost.bytes
            row["start"] = ins.cycle if row["start"] is None else min(row["start"], ins.cycle)
            row["end"] = max(row["end"], ins.cycle + cost.cycles)
            row["units"].add(ins.unit.name)
            row["bound"][cost.bound] += cost.cycles
        for const in program.constants:
            high_water = max(high_water, const.ref.end)
        layer_rows = [{"name": name, "cycles_busy": r["cycles_busy"], "start": r["start"], "end": r["end"],
                       "flops": r["flops"], "bytes": r["bytes"], "units": sorted(r["units"]),
                       "bound": max(r["bound"], key=r["bound"].get)} for name, r in layers.items()]
        return RunStats(makespan, program.predicted_cycles, chip.clock_hz, busy,
                        {u.name: chip.unit_count(u.name) for u in Unit}, high_water, moved, host, flops,
                        sum(c.cycles for c in self.costs), layer_rows)

    @property
    def inputs(self) -> tuple:
        return self.program.inputs

    @property
    def outputs(self) -> tuple:
        return self.program.outputs

    def _check_inputs(self, inputs) -> list:
        expected = self.program.inputs
        if len(inputs) != len(expected):
            raise CallError(f"program takes {len(expected)} inputs, got {len(inputs)}")
        arrays = []
        for i, (value, sig) in enumerate(zip(inputs, expected)):
            arr = np.asarray(value)
            if arr.shape != tuple(sig.shape) or arr.dtype != sig.dtype.np:
                raise CallError(f"input {i}: expected {sig.dtype.np}{list(sig.shape)}, "
                                f"got {arr.dtype}{list(arr.shape)}")
            arrays.append(arr)
        return arrays

    def _check_outputs(self, outputs) -> list:
        expected = self.program.outputs
        if outputs is None:
            return [np.empty(s.shape, s.dtype.np) for s in expected]
        if len(outputs) != len(expected):
            raise CallError(f"program writes {len(expected)} outputs, got {len(outputs)} buffers")
        for i, (arr, sig) in enumerate(zip(outputs, expected)):
            if arr.shape != tuple(sig.shape) or arr.dtype != sig.dtype.np:
                raise CallError(f"output {i}: expected {sig.dtype.np}{list(sig.shape)}, "
                                f"got {arr.dtype}{list(arr.shape)}")
        return list(outputs)

    def run(self, inputs, outputs=None) -> list:
        """Execute the program on host arrays.

        Parameters
        ----------
        inputs : sequence of array-like
            One per program input, with exactly its shape and dtype.
        outputs : sequence of numpy arrays, optional
            Buffers to write into; allocated when omitted.

        Returns
        -------
        list of numpy.ndarray
            The outputs.
        """
        host_in = self._check_inputs(inputs)
        host_out = self._check_outputs(outputs)
        with np.errstate(all="ignore"), self._lock:
            for fn, op, outs, ins, attrs in self._bound:
                if op == Opcode.LOAD:
                    fn(outs, [host_in[attrs["index"]]], attrs)
                elif op == Opcode.STORE:
                    fn([host_out[attrs["index"]]], ins, attrs)
                else:
                    fn(outs, ins, attrs)
        return host_out

