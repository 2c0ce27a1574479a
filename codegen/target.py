"""What a compile is for: one frozen, hashable :class:`Target`, parsed once at every door and carried down.

The chip and the system travel as objects (:class:`~lpx_tvm.runtime_sim.ChipConfig`,
:class:`~lpx_tvm.runtime_sim.system.SystemConfig`), not as names each layer resolves again. A door parses the
user's words once: :meth:`Target.parse` in Python (``lpx_tvm.compile``), :meth:`Target.from_args` on the command
line (its flags made by :meth:`Target.add_arguments` from the fields), :meth:`Target.from_dict` where TVM hands
the codegen its options (``RunCodegen(target_options=...)``, names or a derived chip's parameters).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

from ..runtime_sim import ChipConfig, load_config
from ..runtime_sim.config import config_from_dict
from ..runtime_sim.errors import LpxUserError
from ..runtime_sim.isa import STORAGE_DTYPES
from ..runtime_sim.system import SystemConfig, load_system
from .parallel import choices

DTYPES = STORAGE_DTYPES
TVM_KEY = "lpx.target="  # the key of a TVM target that carries a Target (to_dict's JSON follows it)
DEFAULT_CONFIG = "tsp"  # the chip everything defaults to: patterns, codegen, CLI


@dataclass(frozen=True)
class Target:
    """What is compiled for, validated as it is made.

    Parameters
    ----------
    chip : ChipConfig
        The chip (a system's chip where ``system`` is given).
    system : SystemConfig, optional
        A system of ``chip`` chips, listed link by link; None for one chip.
    dtype : str
        Storage type on lpx: ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"fp8"`` or ``"int8"``.
    parallel : str
        With ``system``: a registered strategy (``"pipeline"``, ``"tensor"``, ``"expert"``, see
        :mod:`.parallel`) or ``"auto"``.
    chips : int, optional
        With ``system``: this many of its chips (default all).
    in_order : bool
        The in-order reference schedule instead of the list scheduler.
    dump_dir : str, optional
        Write each codegen stage's result there.
    gpu : optional
        For ``plan``: the GPU pool beside the LPX system (the app's ``GpuSystem``, parsed at its door; the
        compiler never reads it).
    """

    chip: ChipConfig
    system: SystemConfig | None = None
    dtype: str = "fp32"
    parallel: str = "pipeline"
    chips: int | None = None
    in_order: bool = False
    dump_dir: str | None = None
    gpu: object = None

    def __post_init__(self):
        if not isinstance(self.chip, ChipConfig):
            raise LpxUserError(f"a Target's chip is a ChipConfig (Target.parse takes a name), got {self.chip!r}")
        if self.system is not None:
            if not isinstance(self.system, SystemConfig):
                raise LpxUserError(f"a Target's system is a SystemConfig (Target.parse takes a name), got "
                                   f"{self.system!r}")
            if self.system.chip.digest != self.chip.digest:
                raise LpxUserError(f"system {self.system.name!r} is made of {self.system.chip.name!r} chips, not "
                                   f"{self.chip.name!r}")
            if self.parallel not in choices():
                raise LpxUserError(f"parallel must be one of {', '.join(choices())}, got {self.parallel!r}")
            if self.chips is not None and not (isinstance(self.chips, int) and 1 <= self.chips <= self.system.chips):
                raise LpxUserError(f"chips must be 1..{self.system.chips} on {self.system.name!r}, got {self.chips}")
        elif self.chips is not None or self.parallel != "pipeline":  # one chip: no mapping to choose
            given = f"chips={self.chips!r}" if self.chips is not None else f"parallel={self.parallel!r}"
            raise LpxUserError(f"{given} needs a system of chips to run on (system=...)")
        if not isinstance(self.in_order, bool):
            raise LpxUserError(f"in_order must be a bool, got {self.in_order!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise LpxUserError(f"dump_dir must be a folder's path, got {self.dump_dir!r}")
        if self.dtype not in DTYPES:
            raise LpxUserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.chip.check_dtype(self.dtype)
        if self.gpu is not None and not (isinstance(getattr(self.gpu, "name", None), str)
                                         and isinstance(getattr(self.gpu, "gpus", None), int)):
            raise LpxUserError(f"a Target's gpu is a GPU pool (a name and a count of GPUs), got {self.gpu!r}")

    def check_compilable(self) -> None:
        """Refuse what a plan can target but a compile cannot: a system described by its figures alone (a
        compile needs its links listed one by one) or a GPU pool."""
        if self.system is not None and not self.system.simulated:
            raise LpxUserError(f"system {self.system.name!r} is described, not listed link by link: plan for it "
                               "with lpx-tvm plan; compile for a node or a rack")
        if self.gpu is not None:
            raise LpxUserError("a GPU pool is planned beside LPX (lpx-tvm plan --gpu), not compiled for")

    # ---- the doors ------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, config=None, system=None, dtype: str = "fp32", parallel: str = "pipeline",
              chips: int | None = None, in_order: bool = False, dump_dir: str | None = None, gpu=None) -> "Target":
        """A target from the words a user writes: a chip preset name, JSON file or config (default: the system's
        chip, else ``tsp``), a system preset name, JSON file or config; the rest as the fields."""
        system = None if system is None else system_of(system)
        chip = system.chip if config is None and system is not None else chip_of(config or DEFAULT_CONFIG)
        return cls(chip, system, dtype, parallel, chips, in_order, dump_dir, gpu)

    def to_dict(self) -> dict:
        """Plain values for ``RunCodegen(target_options={"lpx": ...})`` and sweep specs: names, or a chip's own
        parameters where it is not a preset (a derived design point), so :meth:`from_dict` needs no registry."""
        chip = self.chip.name if _is_preset(self.chip) else json.dumps(_chip_params(self.chip), sort_keys=True)
        return {"config": chip, "system": None if self.system is None else self.system.name, "dtype": self.dtype,
                "parallel": self.parallel, "chips": self.chips, "in_order": self.in_order,
                "dump_dir": None if self.dump_dir is None else str(self.dump_dir)}

    @classmethod
    def from_dict(cls, options: dict | None) -> "Target":
        """The target :meth:`to_dict` wrote (or the same keys written by hand)."""
        options = dict(options or {})
        known = {"config", "system", "dtype", "parallel", "chips", "in_order", "dump_dir"}
        if set(options) - known:
            raise LpxUserError(f"unknown lpx target options {sorted(set(options) - known)}; known: "
                               f"{', '.join(sorted(known))}")
        config = options.pop("config", None)
        if isinstance(config, str) and config.startswith("{"):
            config = config_from_dict(json.loads(config))
        return cls.parse(config, **options)

    def tvm_target(self):
        """A TVM target that carries this one: ``tvm.compile(mod, target=t.tvm_target())`` offloads to lpx for
        it (the plain ``"lpx"`` tag means the defaults, ``tsp`` and fp32). TVM targets take no attribute of ours,
        so the target travels as one of its keys."""
        import tvm

        carried = TVM_KEY + json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return tvm.target.Target({"kind": "llvm", "keys": ["lpx", "cpu", carried]})

    @classmethod
    def from_tvm(cls, target) -> "Target":
        """The target a TVM target carries (:meth:`tvm_target`); the defaults where it carries none."""
        carried = [str(key)[len(TVM_KEY):] for key in target.keys if str(key).startswith(TVM_KEY)]
        return cls.from_dict(json.loads(carried[0])) if carried else cls.parse()

    @staticmethod
    def add_arguments(parser, system: bool = True, dtypes=DTYPES, dtype_help: str | None = None) -> None:
        """Add the target's flags to an ``argparse`` parser, one a field: ``--config``, ``--dtype`` (of
        ``dtypes``) and, with ``system``, ``--system``, ``--parallel`` and ``--chips``."""
        from ..runtime_sim.config import available_configs
        from ..runtime_sim.system import available_systems
        from .parallel import STRATEGIES

        parser.add_argument("--config", help=f"chip preset ({', '.join(available_configs())}) or a JSON preset file "
                            "(default tsp; with --system, its chip)")
        if system:
            parser.add_argument("--system", help=f"run on a system of chips ({', '.join(available_systems())}); "
                                "default one chip")
            strategies = "; ".join(f"{s.name}: {s.summary}" for s in STRATEGIES.values())
            parser.add_argument("--parallel", choices=choices(),
                                help=f"with --system, how to map the model ({strategies}; auto: expert for a "
                                "mixture of experts, else the fastest of the others)")
            parser.add_argument("--chips", type=int, help="with --system: use this many of its chips (default: a "
                                "pipeline takes as many as shorten its longest stage, tensor parallel all)")
        parser.add_argument("--dtype", default="fp32", choices=list(dtypes),
                            help=dtype_help or "storage type on lpx (default fp32)")

    @classmethod
    def from_args(cls, args) -> "Target":
        """The target an ``argparse`` namespace of :meth:`add_arguments`' flags names."""
        return cls.parse(getattr(args, "config", None), getattr(args, "system", None), getattr(args, "dtype", "fp32"),
                         getattr(args, "parallel", None) or "pipeline", getattr(args, "chips", None))

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def config(self) -> str:
        """The chip's name (what a program records)."""
        return self.chip.name

    def key(self) -> str:
        """A stable id of what is compiled for: the chip by its parameters (two chips of one name differ), the
        system by its name and size, the dtype, the mapping and the schedule mode (not the dump folder)."""
        parts = [self.chip.digest.hex(), "" if self.system is None else f"{self.system.name}:{self.system.chips}",
                 self.dtype, self.parallel, str(self.chips), str(self.in_order)]
        if self.gpu is not None:
            parts.append(f"{self.gpu.name}:{self.gpu.gpus}")
        return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def chip_of(config) -> ChipConfig:
    """The chip a user's words name: a preset name, a JSON file or a :class:`ChipConfig` (returned as it is).
    With :func:`system_of`, the one place outside the presets that turns names into machines."""
    return load_config(config)


def system_of(system) -> SystemConfig:
    """The system a user's words name: a preset name (``tsp-node``, ``lpx-rack``, ...), a JSON file or a
    :class:`SystemConfig` (returned as it is)."""
    return load_system(system)


def _is_preset(chip: ChipConfig) -> bool:
    from ..runtime_sim.config import available_configs

    return chip.name in available_configs() and load_config(chip.name).digest == chip.digest


def _chip_params(chip: ChipConfig) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in asdict(chip).items()}
