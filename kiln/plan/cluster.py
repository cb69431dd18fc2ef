"""Cluster descriptions: a TOML file (or a preset under kiln/resources/clusters/) read through the
one config engine (kiln/config.py: typed fields, `ranged` rules, one-line errors naming the key).

A cluster is nodes x devices with an alpha-beta link inside a node (NVLink/NVSwitch) and one
between nodes (InfiniBand/RoCE; fat-tree or rail-only; optionally with in-network reduction such
as SHARP), optionally `islands`: groups of nodes joined by a slower link still (one DiLoCo
replica per island, kiln/plan/diloco.py), the process-group backend (nccl, or gloo for CPU
processes), a device efficiency curve eff(w) = max_efficiency * w / (w + half_efficiency_work)
for w = tokens * dim of one matmul pass, and a node MTBF for checkpoint intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from kiln.config import check_fields, fill_dataclass, ranged, read_toml, tomllib
from kiln.errors import ConfigError


@dataclass
class DeviceSpec:
    name: str = "device"
    memory_gib: float = ranged(80.0, gt=0.0)
    usable_fraction: float = ranged(0.92, gt=0.0, le=1.0)
    peak_tflops_bf16: float = ranged(989.0, gt=0.0)
    peak_tflops_fp32: float = ranged(67.0, gt=0.0)
    peak_tflops_fp8: float = ranged(0.0, ge=0.0)  # 0: no float8 tensor cores
    memory_bandwidth_gbps: float = ranged(3350.0, gt=0.0)
    max_efficiency: float = ranged(0.6, gt=0.0, le=1.0)
    half_efficiency_work: float = ranged(2e6, ge=0.0)

    def peak_flops(self, precision: str) -> float:
        tflops = {"fp32": self.peak_tflops_fp32, "bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_bf16,
                  "float8": self.peak_tflops_fp8 or self.peak_tflops_bf16}[precision]
        return tflops * 1e12

    def efficiency(self, work: float) -> float:
        """Fraction of peak reached by matmuls over `work` = tokens * dim per pass."""
        return self.max_efficiency * work / (work + self.half_efficiency_work)

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * 2**30 * self.usable_fraction


@dataclass
class LinkSpec:
    name: str = "link"
    latency_us: float = ranged(5.0, ge=0.0)  # alpha: per message step
    bandwidth_gbps: float = ranged(50.0, gt=0.0)  # beta^-1: GB/s per device, one direction
    topology: str = ranged("fat_tree", choices=("fat_tree", "rail_only"))
    in_network_reduction: bool = False  # SHARP-style: an all-reduce moves each byte once, not twice


@dataclass
class Cluster:
    name: str = "cluster"
    nodes: int = ranged(1, gt=0, le=1_000_000)
    gpus_per_node: int = ranged(8, gt=0, le=1024)
    mtbf_node_hours: float = ranged(2000.0, gt=0.0)
    cost_per_gpu_hour: float = ranged(0.0, ge=0.0)
    storage_write_gbps: float = ranged(5.0, gt=0.0)  # checkpoint write bandwidth per node
    # Fraction of a communication that overlapping strategies hide behind compute.
    overlap_efficiency: float = ranged(0.9, ge=0.0, le=1.0)
    # Host cost of issuing one collective (dispatch, FSDP2 hooks, buffer setup), on top of alpha.
    collective_launch_us: float = ranged(0.0, ge=0.0)
    # Cores a node's processes share (CPU/gloo); 0: every device computes on its own.
    cores_per_node: float = ranged(0.0, ge=0.0)
    # The process-group backend: gloo runs a reduce-scatter as an all-reduce (kiln/plan/timing.py).
    backend: str = ranged("nccl", choices=("nccl", "gloo"))
    # Islands (kiln/plan/diloco.py): the nodes split into `islands` equal groups, each joined to the
    # others by one link its devices share: `island_link_gbps` GB/s one direction for the whole
    # island (a WAN or a datacenter interconnect; not per device, unlike the links below) and
    # `island_link_latency_ms` per message step. kiln plan lays out one DiLoCo replica per island.
    islands: int = ranged(1, gt=0, le=1_000_000)
    island_link_gbps: float = ranged(1.25, gt=0.0)  # 10 Gb/s
    island_link_latency_ms: float = ranged(10.0, ge=0.0)
    device: DeviceSpec = field(default_factory=DeviceSpec)
    intra_node: LinkSpec = field(default_factory=LinkSpec)
    inter_node: LinkSpec = field(default_factory=LinkSpec)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def mtbf_hours(self) -> float:
        """The whole job's mean time between failures: independent nodes fail N times as often."""
        return self.mtbf_node_hours / self.nodes

    def validate(self, source: str = "") -> "Cluster":
        check_fields(self, "", source)
        for name in ("device", "intra_node", "inter_node"):
            check_fields(getattr(self, name), f"{name}.", source)
        if self.nodes % self.islands:
            raise ConfigError(f"{source + ': ' if source else ''}islands={self.islands} must divide nodes="
                              f"{self.nodes} (an island is a group of whole nodes)")
        return self

    @property
    def nodes_per_island(self) -> int:
        return self.nodes // self.islands


SECTIONS = {"device": DeviceSpec, "intra_node": LinkSpec, "inter_node": LinkSpec}


def preset_names() -> list[str]:
    root = resources.files("kiln.resources") / "clusters"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def cluster_from_dict(raw: dict, source: str) -> Cluster:
    flat = {k: v for k, v in raw.items() if k not in SECTIONS}
    cluster = fill_dataclass(Cluster, flat, source)
    for name, cls in SECTIONS.items():
        if name in raw:
            if not isinstance(raw[name], dict):
                raise ConfigError(f"{source}: [{name}] must be a table of keys")
            setattr(cluster, name, fill_dataclass(cls, raw[name], source, f"{name}."))
    return cluster.validate(source)


def load_cluster(spec: str, nodes: int | None = None, islands: int | None = None) -> Cluster:
    """A preset name (h100, a100, ...) or a TOML path; `nodes` and `islands` override the file's."""
    if spec.endswith(".toml") or "/" in spec:
        path = Path(spec)
        cluster = cluster_from_dict(read_toml(path, "cluster file"), str(path))
    else:
        if spec not in preset_names():
            raise ConfigError(f"unknown cluster {spec!r}; presets: {', '.join(preset_names())} "
                              f"(or a path to a cluster TOML, see docs/plan.md)")
        text = (resources.files("kiln.resources") / "clusters" / f"{spec}.toml").read_text(encoding="utf-8")
        cluster = cluster_from_dict(tomllib.loads(text), f"preset {spec}")
    if nodes is not None:
        if nodes < 1:
            raise ConfigError(f"--nodes {nodes} must be >= 1")
        cluster.nodes = nodes
    if islands is not None:
        if islands < 1:
            raise ConfigError(f"--islands {islands} must be >= 1")
        cluster.islands = islands
    if nodes is not None or islands is not None:
        cluster.validate(f"{spec} with --nodes/--islands")
    return cluster
