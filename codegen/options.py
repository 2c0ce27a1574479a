"""The lpx codegen's options: one frozen dataclass, validated as it is made."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..runtime_sim import ChipConfig, load_config
from ..runtime_sim.errors import LpxUserError
from ..runtime_sim.isa import STORAGE_DTYPES
from .parallel import choices

DTYPES = STORAGE_DTYPES
DEFAULT_CONFIG = "tsp"  # the chip everything defaults to: patterns, codegen, CLI


@dataclass(frozen=True)
class CodegenOptions:
    """Options of the lpx codegen, validated on construction.

    Parameters
    ----------
    config : str
        Chip preset name, path to a JSON preset, or a ChipConfig (a derived variant).
    in_order : bool
        Use the in-order reference schedule instead of the list scheduler.
    dump_dir : str, optional
        Write each stage's result there.
    dtype : str
        Storage type on lpx: ``"fp32"`` (default), ``"fp16"``, ``"bf16"``, ``"fp8"`` or ``"int8"``.
    system : str, optional
        Compile for a system of ``config`` chips (a preset such as ``"tsp-node"``, or a JSON file).
    parallel : str
        How to map a model onto the system: a registered strategy (``"pipeline"``, ``"tensor"``,
        ``"expert"``, see :mod:`.parallel`) or ``"auto"``.
    chips : int, optional
        Use this many of the system's chips (default: all).
    """

    config: str = DEFAULT_CONFIG
    in_order: bool = False
    dump_dir: str | None = None
    dtype: str = "fp32"
    system: str | None = None
    parallel: str = "pipeline"
    chips: int | None = None

    def __post_init__(self):
        chip = load_config(self.config)  # raises a clear error for an unknown preset
        if self.system is not None:
            from ..runtime_sim.system import load_system

            system = load_system(self.system)
            if not system.simulated:
                raise LpxUserError(f"system {system.name!r} is described, not listed link by link: plan for it with "
                                   "lpx-tvm plan; compile for a node or a rack")
            if system.chip.digest != chip.digest:
                raise LpxUserError(f"system {system.name!r} is made of {system.chip.name!r} chips, not {chip.name!r}")
            if self.parallel not in choices():
                raise LpxUserError(f"parallel must be one of {', '.join(choices())}, got {self.parallel!r}")
            if self.chips is not None and not 1 <= self.chips <= system.chips:
                raise LpxUserError(f"chips must be 1..{system.chips} on {system.name!r}, got {self.chips}")
        elif self.chips is not None or self.parallel != "pipeline":  # (else ignored: one chip, no system)
            given = f"chips={self.chips!r}" if self.chips is not None else f"parallel={self.parallel!r}"
            raise LpxUserError(f"{given} needs a system of chips to run on (system=...)")
        if not isinstance(self.in_order, bool):
            raise LpxUserError(f"in_order must be a bool, got {self.in_order!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise LpxUserError(f"dump_dir must be a folder's path, got {self.dump_dir!r}")
        if self.dtype not in DTYPES:
            raise LpxUserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        chip.check_dtype(self.dtype)

    @classmethod
    def from_dict(cls, options: dict | None) -> "CodegenOptions":
        options = dict(options or {})
        known = {"config", "in_order", "dump_dir", "dtype", "system", "parallel", "chips"}
        if set(options) - known:
            raise LpxUserError(f"unknown lpx codegen options {sorted(set(options) - known)}; "
                               f"known: {', '.join(sorted(known))}")
        return cls(**options)

    @property
    def chip(self) -> ChipConfig:
        return load_config(self.config)
