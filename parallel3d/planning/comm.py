"""Collective and point-to-point times on the right links (ring and tree formulas).

Conventions follow nccl-tests: a collective over n ranks moving ``nbytes`` (the full buffer) at
bus bandwidth B takes 2(n-1)/n * nbytes / B for all-reduce and (n-1)/n * nbytes / B for
all-gather / reduce-scatter, plus one latency per ring step.  Bus bandwidths are achieved
figures (measured by bench/calibrate_planner.py), so protocol overheads are already in them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import ClusterSpec


@dataclass(frozen=True)
class Group:
    """A process group: ``size`` ranks, ``per_node`` of them on each node it touches."""

    size: int
    per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.size > self.per_node


def group_of(cluster: ClusterSpec, size: int, stride: int) -> Group:
    """The group of ``size`` ranks spaced ``stride`` apart (Megatron's order: TP fastest, then DP, then PP)."""
    if size <= 1:
        return Group(1, 1)
    per_node = max(1, min(size, cluster.gpus_per_node // max(1, stride)))
    return Group(size, per_node)


def _link(cluster: ClusterSpec, group: Group) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency per step in s) of a ring over ``group``.

    Across nodes, every group of the job runs its collective at the same time (all DP groups
    reduce together), so a node's NICs are shared: a group with k ranks on a node gets k NICs'
    worth, one per GPU.  The ring is as fast as its slowest hop.
    """
    intra = cluster.intra_busbw_gbs * 1e9
    if not group.crosses_nodes:
        return intra, cluster.intra_latency_us * 1e-6
    inter = group.per_node * cluster.nic_gbs * 1e9
    return min(intra, inter), cluster.inter_latency_us * 1e-6


def all_reduce_time(cluster: ClusterSpec, group: Group, nbytes: float) -> float:
    """min(ring, tree): NCCL picks the tree for small messages on many nodes, the ring otherwise.

    Ring: 2(n-1) steps, each rank sends 2(n-1)/n of the buffer.  Double binary tree:
    2 log2(n) steps, each rank sends and receives the whole buffer twice (up, then down).
    """
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _link(cluster, group)
    ring = 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
    tree = 2 * math.ceil(math.log2(n)) * lat + 2 * nbytes / bw
    return min(ring, tree)


def all_gather_time(cluster: ClusterSpec, group: Group, nbytes: float) -> float:
    """All-gather (or reduce-scatter) of a buffer of ``nbytes`` in total: one ring pass."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _link(cluster, group)
    return (n - 1) * lat + (n - 1) / n * nbytes / bw


reduce_scatter_time = all_gather_time  # the same ring pass in the other direction


def p2p_time(cluster: ClusterSpec, nbytes: float, across_nodes: bool, tp: int = 1,
             scatter_gather: bool = False) -> float:
    """One pipeline send/receive of ``nbytes``.

    Across nodes each TP rank of a stage sends over its own NIC.  With SC21's scatter-gather
    optimisation each TP rank sends 1/tp of the (replicated) tensor and the receiving stage
    all-gathers it over NVLink, which cuts the inter-node bytes by tp.
    """
    if nbytes <= 0:
        return 0.0
    if not across_nodes:
        return cluster.intra_latency_us * 1e-6 + nbytes / (cluster.intra_p2p_gbs * 1e9)
    if scatter_gather and tp > 1:
        send = cluster.inter_latency_us * 1e-6 + nbytes / tp / (cluster.nic_gbs * 1e9)
        return send + all_gather_time(cluster, Group(tp, tp), nbytes)
    return cluster.inter_latency_us * 1e-6 + nbytes / (cluster.nic_gbs * 1e9)
