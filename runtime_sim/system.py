"""Systems of LPX chips: which chips, which links between them, and the routes transfers take.

A system preset (``systems/*.json``) names its chip preset, its chip count and
its topology; the links are generated from the topology, or listed. Each link
joins two chips, one port on each (a chip's ports are numbered in the order its
links are listed), and carries the chip's link rate each way. A transfer's
first byte takes the chip's C2C latency per hop. Every parameter names its
public source or says it is assumed, as chip presets do.

Topologies:

- ``ring``: chip k to chip k + 1 (and the last to the first when there are more than two);
- ``fully-connected``: ``links_per_pair`` links (default one) between every pair (a TSP node: 8 chips, 7 local
  links each; an LPX node: 16 chips, 4 links a pair);
- ``nodes``: fully connected nodes of ``node_chips`` chips, and between every two nodes
  ``links_per_node_pair`` links, spread over the nodes' chips (a TSP rack: 9 nodes, each chip's 4
  global links to other nodes);
- ``node-grid``: fully connected nodes of ``node_chips`` chips (``links_per_pair`` links a pair), and each chip
  joined by ``links_to_peer`` links to the chip in the same position of every other node (an LPX rack: 16 nodes
  of 16, 2 links to one chip of each other node): any two chips are at most 2 hops apart;
- ``dragonfly``: larger TSP systems, described by their figures (nodes, hops, global bandwidth
  per chip) for planning; they are too large to list link by link, so programs are not simulated on them;
- ``racks``: systems of LPX racks (``lpx-system-N``), described by their figures for planning, each rack an
  ``lpx-rack``;
- ``described``: any other system given by its figures in a system file.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

from .config import ChipConfig, ConfigError, _FrozenDict, load_config

_SYSTEM_DIR = Path(__file__).with_name("systems")
_TSP_SYSTEM = re.compile(r"^tsp-system-(\d+)$")
_LPX_SYSTEM = re.compile(r"^lpx-system-(\d+)$")


@dataclass(frozen=True)
class Link:
    """One link: chip ``a``'s port ``port_a`` to chip ``b``'s port ``port_b``; ``kind`` is local or global."""

    a: int
    b: int
    port_a: int
    port_b: int
    kind: str = "local"

    def ends(self, chip: int) -> tuple:
        """(this chip's port, the other chip, its port) seen from ``chip``."""
        return (self.port_a, self.b, self.port_b) if chip == self.a else (self.port_b, self.a, self.port_a)


@dataclass(frozen=True)
class SystemConfig:
    """A system: ``chips`` copies of one chip preset and the links between them.

    Parameters
    ----------
    name : str
    chip : ChipConfig
    chips : int
    topology : str
        ``ring``, ``fully-connected``, ``nodes`` or ``dragonfly`` (see the module docstring).
    links : tuple of Link
        Empty for a ``dragonfly`` system (described by ``figures``).
    figures : dict
        Topology figures: ``node_chips``, ``nodes``, ``max_hops``, ``global_bytes_per_s_per_chip``, ...
    sources : dict
        Parameter ─► its public source, or "assumed: ...".
    """

    name: str
    chip: ChipConfig
    chips: int
    topology: str
    links: tuple = ()
    figures: dict = field(default_factory=dict)
    description: str = field(default="", compare=False)
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.chips < 1:
            raise ConfigError(f"system {self.name!r}: chips must be >= 1, got {self.chips}")
        for name in ("figures", "sources"):  # read-only and hashable, as a chip's (a Target holds the system)
            object.__setattr__(self, name, _FrozenDict(getattr(self, name)))
        ports = {}
        for link in self.links:
            for chip, port in ((link.a, link.port_a), (link.b, link.port_b)):
                if not 0 <= chip < self.chips:
                    raise ConfigError(f"system {self.name!r}: a link names chip {chip} of {self.chips}")
                if port in ports.setdefault(chip, set()) or not 0 <= port < self.chip.c2c_links:
                    raise ConfigError(f"system {self.name!r}: chip {chip} port {port} is used twice or does not "
                                      f"exist (the {self.chip.name} chip has {self.chip.c2c_links} links)")
                ports[chip].add(port)

    @property
    def simulated(self) -> bool:
        """Whether its links are listed (programs can run on it), rather than only described."""
        return bool(self.links) or self.chips == 1

    @property
    def hop_cycles(self) -> int:
        """Cycles a transfer's first byte takes over one link (the chip's C2C latency)."""
        return self.chip.latency_cycles["C2C"]

    @property
    def link_bytes_per_cycle(self) -> float:
        return self.chip.c2c_bytes_per_cycle

    def ports(self, chip: int) -> dict:
        """Port ─► (peer chip, peer's port, link index) for every link of ``chip``."""
        return self._port_table.get(chip, {})

    @cached_property
    def _port_table(self) -> dict:
        table = {}
        for k, link in enumerate(self.links):
            for end in (link.a, link.b):
                port, peer, peer_port = link.ends(end)
                table.setdefault(end, {})[port] = (peer, peer_port, k)
        return table

    def port_to(self, chip: int, peer: int) -> int:
        """``chip``'s (first) port on a link to ``peer``; a ValueError when they are not neighbours."""
        for port, (other, _, _) in sorted(self.ports(chip).items()):
            if other == peer:
                return port
        raise ValueError(f"system {self.name!r}: chips {chip} and {peer} share no link")

    def route(self, src: int, dst: int) -> tuple:
        """The hops of a transfer from ``src`` to ``dst``: ``(from chip, its port, to chip, its port)``,
        the shortest path (fewest hops, then lowest chip numbers)."""
        routes = self.__dict__.setdefault("_routes", {})
        if (src, dst) not in routes:
            routes[(src, dst)] = _route(self, src, dst)
        return routes[(src, dst)]

    def links_between(self, chip: int, peer: int) -> tuple:
        """``(chip's port, peer's port)`` of every link joining ``chip`` and ``peer``, in the order the links are
        listed: the k-th of them is the same link seen from either end."""
        return tuple((port, peer_port) for port, (other, peer_port, _) in
                     sorted(self.ports(chip).items(), key=lambda kv: kv[1][2]) if other == peer)

    def neighbours(self, chip: int) -> list:
        return sorted({peer for peer, _, _ in self.ports(chip).values()})

    @property
    def digest(self) -> bytes:
        payload = json.dumps({"chip": self.chip.digest.hex(), "chips": self.chips, "topology": self.topology,
                              "links": [(l.a, l.b, l.port_a, l.port_b) for l in self.links],
                              "figures": self.figures}, sort_keys=True)
        return hashlib.blake2b(payload.encode(), digest_size=8).digest()


def _route(system: SystemConfig, src: int, dst: int) -> tuple:
    if src == dst:
        return ()
    previous = {src: None}
    queue = deque([src])
    while queue:
        chip = queue.popleft()
        if chip == dst:
            break
        for port, (peer, peer_port, _) in sorted(system.ports(chip).items(), key=lambda kv: (kv[1][0], kv[0])):
            if peer not in previous:
                previous[peer] = (chip, port, peer_port)
                queue.append(peer)
    if dst not in previous:
        raise ValueError(f"system {system.name!r}: no route from chip {src} to chip {dst}")
    hops, chip = [], dst
    while previous[chip] is not None:
        before, port, peer_port = previous[chip]
        hops.append((before, port, chip, peer_port))
        chip = before
    return tuple(reversed(hops))


# ---- presets -------------------------------------------------------------------------------------------------
def available_systems() -> list:
    """Names of the shipped system presets (``tsp-system-N`` is built for any N of whole nodes)."""
    return sorted(p.stem for p in _SYSTEM_DIR.glob("*.json")) + ["tsp-system-N", "lpx-system-N"]


def load_system(system) -> SystemConfig:
    """A system from a preset name, ``tsp-system-N``, a JSON file, or a SystemConfig."""
    if isinstance(system, SystemConfig):
        return system
    return _load_system(str(system))


@lru_cache(maxsize=None)
def _load_system(text: str) -> SystemConfig:
    match = _TSP_SYSTEM.match(text)
    if match:
        return _tsp_system(int(match.group(1)))
    match = _LPX_SYSTEM.match(text)
    if match:
        return _lpx_system(int(match.group(1)))
    path = _SYSTEM_DIR / f"{text}.json"
    if not path.is_file():
        path = Path(text)
        if path.suffix != ".json" and "/" not in text:
            raise ConfigError(f"unknown system {text!r}; presets: {', '.join(available_systems())}")
        if not path.is_file():
            raise ConfigError(f"system file {text!r}: no such file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"system file {text!r}: not JSON ({err})") from None
    return system_from_dict(data)


_SYSTEM_KEYS = {"name", "description", "chip", "chips", "topology", "links", "figures", "sources"}


def system_from_dict(data: dict) -> SystemConfig:
    """Build a system from its preset dict, naming unknown keys and missing sources."""
    unknown = sorted(set(data) - _SYSTEM_KEYS)
    if unknown:
        raise ConfigError(f"system {data.get('name', '?')!r}: unknown keys {unknown}")
    chip = load_config(data["chip"])
    topology = data.get("topology", {})
    kind = topology.get("kind") if isinstance(topology, dict) else topology
    chips = int(data["chips"])
    if "links" in data:
        links = tuple(Link(*l) if isinstance(l, list) else Link(**l) for l in data["links"])
    elif kind == "described":  # a system too large to list: its figures serve planning
        links = ()
    else:
        links = _generate(kind, chips, topology, data.get("name", "?"))
    sources = data.get("sources", {})
    for key in ("chip", "chips", "topology"):
        if sources and key not in sources:
            raise ConfigError(f"system {data.get('name')!r}: no source given for {key}")
    return SystemConfig(data["name"], chip, chips, kind, links, dict(data.get("figures", {})),
                        data.get("description", ""), sources)


def _generate(kind: str, chips: int, topology: dict, name: str) -> tuple:
    links, next_port = [], [0] * chips

    def join(a, b, kind_="local"):
        links.append(Link(a, b, next_port[a], next_port[b], kind_))
        next_port[a] += 1
        next_port[b] += 1

    def whole_nodes(size: int, per_pair: int) -> int:
        """Join every pair of chips within each node of ``size`` by ``per_pair`` links; the node count."""
        if chips % size:
            raise ConfigError(f"system {name!r}: {chips} chips are not whole nodes of {size}")
        for n in range(chips // size):
            for a in range(size):
                for b in range(a + 1, size):
                    for _ in range(per_pair):
                        join(n * size + a, n * size + b)
        return chips // size

    if kind == "ring":
        for k in range(chips - 1):
            join(k, k + 1)
        if chips > 2:
            join(chips - 1, 0)
    elif kind == "fully-connected":
        for a in range(chips):
            for b in range(a + 1, chips):
                for _ in range(int(topology.get("links_per_pair", 1))):
                    join(a, b)
    elif kind == "nodes":
        size, per_pair = int(topology["node_chips"]), int(topology["links_per_node_pair"])
        nodes = whole_nodes(size, 1)
        # node n's j-th global link to node m leaves from chip (slot of m among n's peers · per_pair + j) mod size
        for n in range(nodes):
            for m in range(n + 1, nodes):
                for j in range(per_pair):
                    slot_n, slot_m = (m - n - 1) * per_pair + j, (n - m - 1) % nodes * per_pair + j
                    join(n * size + slot_n % size, m * size + slot_m % size, "global")
    elif kind == "node-grid":
        size, local, peer = (int(topology[k]) for k in ("node_chips", "links_per_pair", "links_to_peer"))
        nodes = whole_nodes(size, local)
        for position in range(size):
            for n in range(nodes):
                for m in range(n + 1, nodes):
                    for _ in range(peer):
                        join(n * size + position, m * size + position, "global")
    else:
        raise ConfigError(f"system {name!r}: unknown topology {kind!r} (ring, fully-connected, nodes, node-grid)")
    return tuple(links)


RACK_REACH_S = 1.60e-6  # Hot Chips 2026: the SRAM of 3 racks reached in 1.60 us (see _lpx_system's sources)


def _lpx_system(racks: int) -> SystemConfig:
    """``lpx-system-N``: N LPX racks (each an ``lpx-rack``, listed link by link), joined rack to rack, described
    by their figures for planning: a tensor-parallel group stays within a rack; pipeline stages cross racks."""
    rack = _load_system("lpx-rack")
    if not 1 <= racks <= 16:
        raise ConfigError(f"lpx-system-{racks}: 1 to 16 racks (the largest SRAM reach NVIDIA quotes is 1,152 GB: 9 "
                          "racks' worth, Hot Chips 2026)")
    figures = {"node_chips": rack.chips, "node_system": "lpx-rack", "racks": racks, "max_hops": 3,
               "rack_hop_cycles": round(RACK_REACH_S * rack.chip.clock_hz)}
    sources = {
        "chip": rack.sources["chip"],
        "chips": "assumed: N racks of 256 LP30s (official: NVIDIA's LPX rack is 256 LPUs)",
        "topology": "third-party: SemiAnalysis, GTC 2026 LPX article: 4 x 100G a chip from rack to rack (OSFP, AEC)",
        "rack_hop_cycles": "official: Hot Chips 2026 (Arsovski, Raghavan): SRAM reached in 1.15 us at 128 GB (a rack) "
                           "and 1.60 us at 384 GB (3 racks); a stage's hand-off to the next rack is priced at the "
                           "larger, 1.60 us (at the chip's clock: 1,600 cycles at lp30's assumed 1 GHz): a bound, "
                           "not a measured hop",
    }
    return SystemConfig(f"lpx-system-{racks}", rack.chip, racks * rack.chips, "racks", (), figures,
                        f"{racks} LPX racks of 256 LP30s", sources)


def _tsp_system(chips: int) -> SystemConfig:
    """``tsp-system-N``: N TSPs in whole nodes of 8, in the ISCA 2022 topology, described by its figures."""
    chip = load_config("tsp")
    if chips < 8 or chips % 8 or chips > 10_440:
        raise ConfigError(f"tsp-system-{chips}: a TSP system is whole nodes of 8 chips, at most 10,440 (ISCA 2022)")
    nodes = chips // 8
    # up to 33 nodes every node reaches every other over one global link (32 global ports a node); beyond,
    # racks join in a second Dragonfly level: local, global, local within a group, and up to five hops in all
    one_level = nodes <= 33
    global_bytes = (4 if one_level else 1) * chip.c2c_bytes_per_s_per_link
    figures = {"node_chips": 8, "node_system": "tsp-node", "nodes": nodes, "max_hops": 3 if one_level else 5,
               "local_links_per_chip": 7, "global_links_per_chip": 4,
               "global_bytes_per_s_per_chip": global_bytes}
    sources = {
        "chip": "ISCA 2022 (Abts et al.): the system is built of first-generation TSPs",
        "chips": "ISCA 2022 abstract: up to 10,440 TSPs; nodes of 8 (GroqNode, ALCF user guide)",
        "topology": "ISCA 2022 abstract: a software-defined Dragonfly; 7 local + 4 global links a chip (Hot Chips 34 "
                    "slides 34-36); 33 nodes all-to-all over 32 global ports a node (derived)",
        "max_hops": "notes on ISCA 2022 (unverified): 3 hops within 264 TSPs, 5 at most beyond",
        "global_bytes_per_s_per_chip": "notes on ISCA 2022 (unverified): ~50 GB/s a TSP up to 264 TSPs (4 global "
                                       "links), flattening to ~14 GB/s beyond (one link's worth, assumed)",
    }
    return SystemConfig(f"tsp-system-{chips}", chip, chips, "dragonfly", (), figures,
                        f"{chips} TSPs: {nodes} nodes of 8", sources)
