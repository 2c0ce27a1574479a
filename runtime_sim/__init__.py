"""The LPX machine: chip config, ISA, program format, simulator and traces.

This package imports only numpy and ml_dtypes. The simulator is the living
definition of the ISA: what it computes and how many cycles it counts is what an
LPX program means.
"""

from .errors import LpxError, LpxInternalError, LpxUserError
from .config import ChipConfig, available_configs, derive_config, load_config
from .isa import DType, Opcode, Unit, Space, TensorRef, Instruction, OP_TABLE
from .program import Program, Constant, StreamedWeight, ProgramFormatError, encode, decode, disassemble, validate
from .check import ScheduleError, check_timing
from .timing import Occupancy, occupancy
from .simulator import Simulator, RunStats, CallError, reference_arithmetic

__all__ = [
    "LpxError", "LpxUserError", "LpxInternalError",
    "ChipConfig", "load_config", "available_configs", "derive_config",
    "DType", "Opcode", "Unit", "Space", "TensorRef", "Instruction", "OP_TABLE",
    "Program", "Constant", "StreamedWeight", "ProgramFormatError", "encode", "decode", "disassemble", "validate",
    "ScheduleError", "check_timing", "Occupancy", "occupancy", "Simulator", "RunStats", "CallError",
    "reference_arithmetic",
]
