"""Chip configuration: one frozen dataclass, loaded from a preset file.

Everything derived from the preset (stream and SRAM bandwidth, ALUs per lane,
peak rates) is a property computed here, so no number is stored twice. Every
preset names, in its ``sources``, the public figure each parameter comes from or
says that it is assumed; loading a preset checks that none is missing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from .errors import LpxUserError
from .isa import STORAGE_DTYPES, Unit

_CONFIG_DIR = Path(__file__).with_name("configs")
UNIT_NAMES = tuple(u.name for u in Unit)
MXM_DTYPES = STORAGE_DTYPES  # the matrix unit's rate table is keyed by storage type
_NOT_PARAMETERS = ("name", "description", "sources")


class ConfigError(LpxUserError):
    """A chip preset that is malformed, or names no source for a parameter."""


@dataclass(frozen=True)
class ChipConfig:
    """An LPX chip: clock, memories, streams and functional units.

    Parameters
    ----------
    name : str
        Preset name, recorded in every program compiled for this chip.
    clock_hz : int
        Core clock.
    lanes : int
        Elements (bytes) of one vector; one stream moves one vector per cycle.
    streams_per_direction : int
        Streams flowing each way (east, west) between the functional slices.
    sram_bytes, sram_slices : int
        On-chip memory and its slices; each slice reads one vector and writes one per cycle.
    mxm_planes, mxm_rows, mxm_cols : int
        Matrix planes and the MAC array of each.
    mxm_passes : dict
        Cycles each activation vector spends in a plane, per storage dtype (int8 is
        native, 1). A dtype left out is one the chip does not run.
    mxm_weight_buffers : int
        Weight buffers per plane: the next tile installs while the current one computes.
    mxm_install_streams : int
        Streams one plane's weight installation draws.
    stream_hops : int
        Cycles a vector takes from a memory slice to a unit at the chip's edge (a plane's weight buffer).
    vxm_alus : int
        Vector ALUs of the whole chip (``lanes`` × ALUs per lane).
    sxm_vectors_per_cycle : int
        Vectors a switch unit moves per cycle.
    host_bytes_per_s : int
        The host link (every host transfer shares it).
    c2c_links, c2c_bytes_per_s_per_link : int
        Chip-to-chip links.
    unit_counts : dict
        Independent instances of each unit besides the MXM planes and the C2C ports (one per link): DMA
        engines, vector queues, ...
    latency_cycles : dict
        Pipeline and stream-hop latency of each unit's results.
    power_watts : int, optional
        The chip's power at load (its TDP), where a public figure gives it: what a plan's kW counts. It
        changes no program (it is not in the digest).
    sources : dict
        Parameter name ─► the public figure it comes from, or "assumed: ...".
    """

    name: str
    clock_hz: int
    lanes: int
    streams_per_direction: int
    sram_bytes: int
    sram_slices: int
    mxm_planes: int
    mxm_rows: int
    mxm_cols: int
    mxm_passes: dict
    mxm_weight_buffers: int
    mxm_install_streams: int
    stream_hops: int
    vxm_alus: int
    sxm_vectors_per_cycle: int
    host_bytes_per_s: int
    c2c_links: int
    c2c_bytes_per_s_per_link: int
    unit_counts: dict
    latency_cycles: dict
    power_watts: int | None = None
    description: str = field(default="", compare=False)
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.power_watts is not None and (not isinstance(self.power_watts, int) or isinstance(self.power_watts, bool)
                                             or self.power_watts <= 0):
            raise ConfigError(f"chip config {self.name!r}: power_watts must be a positive integer, got "
                              f"{self.power_watts!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"chip config {self.name!r}: {f.name} must be a positive integer, got {value!r}")
        if self.sram_bytes % self.sram_slices:
            raise ConfigError(f"chip config {self.name!r}: sram_bytes must divide into {self.sram_slices} slices")
        if self.vxm_alus % self.lanes:
            raise ConfigError(f"chip config {self.name!r}: vxm_alus must be a multiple of lanes ({self.lanes})")
        unknown = set(self.mxm_passes) - set(MXM_DTYPES)
        if "fp32" not in self.mxm_passes or unknown:
            raise ConfigError(f"chip config {self.name!r}: mxm_passes must give fp32 and may give "
                              f"{', '.join(d for d in MXM_DTYPES if d != 'fp32')}; got {sorted(self.mxm_passes)}")
        if any(not isinstance(v, int) or v <= 0 for v in self.mxm_passes.values()):
            raise ConfigError(f"chip config {self.name!r}: mxm_passes must be positive integers")
        if 2 * self.mxm_install_streams > self.stream_capacity:
            raise ConfigError(f"chip config {self.name!r}: mxm_install_streams exceeds the streams")
        for unit in UNIT_NAMES:
            if unit not in ("MXM", "C2C") and (not isinstance(self.unit_counts.get(unit), int)
                                               or self.unit_counts[unit] < 1):
                raise ConfigError(f"chip config {self.name!r}: unit_counts[{unit!r}] must be an integer >= 1")
            if not isinstance(self.latency_cycles.get(unit), int) or self.latency_cycles[unit] < 0:
                raise ConfigError(f"chip config {self.name!r}: latency_cycles[{unit!r}] must be an integer >= 0")
        if self.sources:
            missing = [f.name for f in fields(self) if f.name not in _NOT_PARAMETERS and f.name not in self.sources
                       and not (f.name == "power_watts" and self.power_watts is None)]
            if missing:
                raise ConfigError(f"chip config {self.name!r}: no source given for {', '.join(missing)}")
        # dicts are not hashable; freeze them so the config can key caches
        for name in ("mxm_passes", "unit_counts", "latency_cycles", "sources"):
            object.__setattr__(self, name, _FrozenDict(getattr(self, name)))

    # ---- derived values -------------------------------------------------
    def check_dtype(self, dtype: str) -> None:
        """Raise a clear error unless the matrix unit runs ``dtype``."""
        if dtype not in self.mxm_passes:
            raise LpxUserError(f"chip config {self.name!r} has no {dtype} matrix unit "
                               f"(it runs {', '.join(sorted(self.mxm_passes))})")

    def unit_count(self, unit_name: str) -> int:
        """Number of independent instances of a unit (the C2C unit's are the chip's link ports)."""
        if unit_name == "MXM":
            return self.mxm_planes
        return self.c2c_links if unit_name == "C2C" else self.unit_counts[unit_name]

    @property
    def stream_capacity(self) -> int:
        """Streams in both directions together."""
        return 2 * self.streams_per_direction

    @property
    def sram_bytes_per_cycle(self) -> int:
        """SRAM read bandwidth (and, separately, write bandwidth): one vector per slice per cycle."""
        return self.sram_slices * self.lanes

    @property
    def vxm_alus_per_lane(self) -> int:
        return self.vxm_alus // self.lanes

    @property
    def sram_slice_bytes(self) -> int:
        return self.sram_bytes // self.sram_slices

    @property
    def host_bytes_per_cycle(self) -> float:
        return self.host_bytes_per_s / self.clock_hz

    @property
    def c2c_bytes_per_cycle(self) -> float:
        """One chip-to-chip link's rate, each direction."""
        return self.c2c_bytes_per_s_per_link / self.clock_hz

    def mxm_peak_macs_per_cycle(self, dtype: str) -> float:
        """MACs per cycle of all planes together for a storage dtype."""
        return self.mxm_planes * self.mxm_rows * self.mxm_cols / self.mxm_passes[dtype]

    def peak_ops_per_s(self, dtype: str) -> float:
        """Peak matrix throughput in operations (2 per MAC) per second."""
        return 2 * self.mxm_peak_macs_per_cycle(dtype) * self.clock_hz

    @property
    def digest(self) -> bytes:
        """8-byte fingerprint of every field that changes what a program means."""
        payload = json.dumps({k: v for k, v in asdict(self).items() if k not in ("description", "sources", "power_watts")},
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
    return config_from_dict(json.loads((_CONFIG_DIR / f"{name}.json").read_text()))


def config_from_dict(data: dict) -> ChipConfig:
    """Build a config from a dict, naming any unknown or missing key."""
    known = {f.name for f in fields(ChipConfig)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"chip config: unknown keys {sorted(unknown)}")
    try:
        return ChipConfig(**data)
    except TypeError as err:
        raise ConfigError(f"chip config: {err}") from None


def derive_config(base: "str | ChipConfig", overrides: dict, name: str | None = None) -> ChipConfig:
    """A variant of ``base`` with some parameters changed, validated.

    It travels as an object (a program it compiles carries its parameters), never by its name alone.

    Parameters
    ----------
    base : str or ChipConfig
        The preset it starts from.
    overrides : dict
        Parameter name ─► new value (a dict parameter such as ``latency_cycles`` is merged key by key).
    name : str, optional
        Default: the base's name and the changes, e.g. ``tsp[sram_bytes=346030080]``.

    Raises
    ------
    ConfigError
        Naming an unknown parameter or a bad value.
    """
    base = load_config(base)
    known = {f.name for f in fields(ChipConfig)} - set(_NOT_PARAMETERS)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"chip config {base.name!r} has no parameter {', '.join(unknown)} "
                          f"(parameters: {', '.join(sorted(known))})")
    data = asdict(base)
    sources = dict(base.sources)
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(data[key], dict) and isinstance(value, dict) else value
        sources[key] = f"assumed: a design variant of {base.name} (there {getattr(base, key)!r})"
    changes = ",".join(f"{k}={_short(v)}" for k, v in sorted(overrides.items()))
    data.update(name=name or f"{base.name}[{changes}]", sources=sources,
                description=f"{base.name} with {changes}" if changes else base.description)
    return config_from_dict(data)


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{v}" for k, v in sorted(value.items())) + "}"
    return str(value)


def load_config(config: "str | Path | ChipConfig") -> ChipConfig:
    """Return a chip config from a preset name, a JSON file path, or a config.

    Parameters
    ----------
    config : str, Path or ChipConfig
        ``"tiny"``, ``"tsp"``, a path to a JSON preset, or a config itself.
    """
    if isinstance(config, ChipConfig):
        return config
    text = str(config)
    if text in available_configs():
        return _load_preset(text)
    path = Path(text)
    if path.suffix == ".json" or "/" in text:
        if not path.is_file():
            raise ConfigError(f"chip config file {text!r}: no such file")
        try:
            return config_from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise ConfigError(f"chip config file {text!r}: not JSON ({err})") from None
    raise ConfigError(f"unknown chip config {text!r}; presets: {', '.join(available_configs())}")
