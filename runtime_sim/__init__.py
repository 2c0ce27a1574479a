"""The LPX machine: chip config, ISA, program format, simulator and traces.

This package imports only numpy and ml_dtypes. The simulator is the living
definition of the ISA: what it computes and how many cycles it counts is what an
LPX program means.
"""

from .config import ChipConfig, load_config, available_configs
from .isa import DType, Opcode, Unit, TensorRef, Instruction
from .program import Program, Constant, StreamedWeight, ProgramFormatError, encode, decode, disassemble, validate
from .simulator import Simulator, ScheduleError, RunStats

__all__ = [
    "ChipConfig", "load_config", "available_configs",
    "DType", "Opcode", "Unit", "TensorRef", "Instruction",
    "Program", "Constant", "StreamedWeight", "ProgramFormatError", "encode", "decode", "disassemble", "validate",
    "Simulator", "ScheduleError", "RunStats",
]
