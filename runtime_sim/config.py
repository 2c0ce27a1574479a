"""Chip configuration: one frozen dataclass, loaded from a preset file.

Everything derived from the preset (unit counts, peak rates, capacities) is a
property computed here, so no number is stored twice.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, asdict
from functools import lru_cache
from pathlib import Path

from .isa import STORAGE_DTYPES, Unit

_CONFIG_DIR = Path(__file__).with_name("configs")
UNIT_NAMES = tuple(u.name for u in Unit)
MXM_DTYPES = STORAGE_DTYPES  # the matrix unit's rate table is keyed by storage type


@dataclass(frozen=True)
class ChipConfig:
    """An LPX chip: clock, memories and functional units.

    Parameters
    ----------
    name : str
        Preset name, recorded in every program compiled for this chip.
    clock_hz : int
        Core clock.
    lanes : int
        Vector width of the streams between units.
    sram_bytes, sram_slices : int
        On-chip memory size and the number of slices it is split into.
    mxm_planes, mxm_rows, mxm_cols : int
        Matrix units: count and the MAC array of each.
    mxm_passes : dict
        Cycles per MAC-array pass for each dtype the matrix unit runs (int8 is
        native, 1). fp32 is not native and is charged as several fp16 passes.
        A dtype left out is one the chip does not run.
    vxm_alus : int
        Vector ALUs, all working on one instruction at a time.
    sxm_bytes_per_cycle, sram_bytes_per_cycle : int
        Switch-unit throughput and total on-chip SRAM bandwidth.
    host_bytes_per_s : int
        Host link (DMA) bandwidth.
    c2c_links, c2c_bytes_per_s_per_link : int
        Chip-to-chip links.
    unit_counts : dict
        How many independent instances of each unit besides the MXM planes.
    latency_cycles : dict
        Fixed pipeline latency added to every instruction of a unit.
    """

    name: str
    clock_hz: int
    lanes: int
    sram_bytes: int
    sram_slices: int
    mxm_planes: int
    mxm_rows: int
    mxm_cols: int
    mxm_passes: dict
    vxm_alus: int
    sxm_bytes_per_cycle: int
    sram_bytes_per_cycle: int
    host_bytes_per_s: int
    c2c_links: int
    c2c_bytes_per_s_per_link: int
    unit_counts: dict
    latency_cycles: dict
    description: str = field(default="", compare=False)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"chip config {self.name!r}: {f.name} must be a positive integer, got {value!r}")
        if self.sram_bytes % self.sram_slices:
            raise ValueError(f"chip config {self.name!r}: sram_bytes must divide into {self.sram_slices} slices")
        unknown = set(self.mxm_passes) - set(MXM_DTYPES)
        if "fp32" not in self.mxm_passes or unknown:
            raise ValueError(f"chip config {self.name!r}: mxm_passes must give fp32 and may give "
                             f"{', '.join(d for d in MXM_DTYPES if d != 'fp32')}; got {sorted(self.mxm_passes)}")
        if any(not isinstance(v, int) or v <= 0 for v in self.mxm_passes.values()):
            raise ValueError(f"chip config {self.name!r}: mxm_passes must be positive integers")
        for unit in UNIT_NAMES:
            if unit != "MXM" and self.unit_counts.get(unit, 0) < 1:
                raise ValueError(f"chip config {self.name!r}: unit_counts[{unit!r}] must be >= 1")
            if self.latency_cycles.get(unit, -1) < 0:
                raise ValueError(f"chip config {self.name!r}: latency_cycles[{unit!r}] missing")
        # dicts are not hashable; freeze them so the config can key caches
        object.__setattr__(self, "mxm_passes", _FrozenDict(self.mxm_passes))
        object.__setattr__(self, "unit_counts", _FrozenDict(self.unit_counts))
        object.__setattr__(self, "latency_cycles", _FrozenDict(self.latency_cycles))

    # ---- derived values -------------------------------------------------
    def check_dtype(self, dtype: str) -> None:
        """Raise a clear error unless the matrix unit runs ``dtype``."""
        if dtype not in self.mxm_passes:
            raise ValueError(f"chip config {self.name!r} has no {dtype} matrix unit "
                             f"(it runs {', '.join(sorted(self.mxm_passes))})")

    def unit_count(self, unit_name: str) -> int:
        """Number of independent instances of a unit."""
        return self.mxm_planes if unit_name == "MXM" else self.unit_counts[unit_name]

    @property
    def sram_slice_bytes(self) -> int:
        return self.sram_bytes // self.sram_slices

    @property
    def host_bytes_per_cycle(self) -> float:
        return self.host_bytes_per_s / self.clock_hz

    def mxm_peak_macs_per_cycle(self, dtype: str) -> float:
        """MACs per cycle of all planes together for a storage dtype."""
        return self.mxm_planes * self.mxm_rows * self.mxm_cols / self.mxm_passes[dtype]

    def peak_ops_per_s(self, dtype: str) -> float:
        """Peak matrix throughput in operations (2 per MAC) per second."""
        return 2 * self.mxm_peak_macs_per_cycle(dtype) * self.clock_hz

    @property
    def digest(self) -> bytes:
        """8-byte fingerprint of every field that changes what a program means."""
        payload = json.dumps({k: v for k, v in asdict(self).items() if k != "description"},
                             sort_keys=True, default=dict)
        return hashlib.blake2b(payload.encode(), digest_size=8).digest()


class _FrozenDict(dict):
    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *args, **kwargs):
        raise TypeError("chip config values are read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly


def available_configs() -> list[str]:
    """Names of the shipped chip presets."""
    return sorted(p.stem for p in _CONFIG_DIR.glob("*.json"))


@lru_cache(maxsize=None)
def _load_preset(name: str) -> ChipConfig:
    path = _CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown chip config {name!r}; presets: {', '.join(available_configs())}")
    return config_from_dict(json.loads(path.read_text()))


def config_from_dict(data: dict) -> ChipConfig:
    """Build a config from a dict, naming any unknown or missing key."""
    known = {f.name for f in fields(ChipConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"chip config: unknown keys {sorted(unknown)}")
    try:
        return ChipConfig(**data)
    except TypeError as err:
        raise ValueError(f"chip config: {err}") from None


def load_config(config: "str | Path | ChipConfig") -> ChipConfig:
    """Return a chip config from a preset name, a JSON file path, or a config.

    Parameters
    ----------
    config : str, Path or ChipConfig
        ``"tiny"``, ``"tsp"``, a path to a JSON preset, or a config itself.
    """
    if isinstance(config, ChipConfig):
        return config
    path = Path(config)
    if path.suffix == ".json" and path.is_file():
        return config_from_dict(json.loads(path.read_text()))
    return _load_preset(str(config))
