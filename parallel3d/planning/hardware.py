"""Cluster descriptions for the planner: GEMM efficiency curve, memory bandwidth, links, memory.

Every number is an *achieved* rate (what a kernel or an NCCL collective really gets), not a
datasheet peak, except ``GemmCurve.peak_tflops``, which only scales the curve.  Presets state
where each number comes from; ``bench/calibrate_planner.py`` measures them on a GPU machine and
writes a JSON file that ``load_cluster`` reads (``tools/plan.py --cluster-file``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

GIB = 2 ** 30


@dataclass(frozen=True)
class GemmCurve:
    """Achieved GEMM throughput as a function of shape.

    efficiency(m, n, k) = max_efficiency / (1 + half_dim * (1/m + 1/n + 1/k)): a small dimension
    costs tile quantisation and too few waves, and this form makes peak/achieved LINEAR in
    (1/m + 1/n + 1/k), so a handful of measured GEMMs fit it by least squares (``fit``).
    """

    peak_tflops: float  # dense bf16 datasheet peak; the MFU denominator
    max_efficiency: float  # fraction of peak reached by very large GEMMs
    half_dim: float  # a dimension this small costs a factor 2 on its own
    wgrad_factor: float = 1.0  # weight-gradient GEMMs accumulate into fp32 main_grad: relative speed

    def efficiency(self, m: float, n: float, k: float) -> float:
        return self.max_efficiency / (1.0 + self.half_dim * (1.0 / m + 1.0 / n + 1.0 / k))

    @classmethod
    def fit(cls, points: list[tuple[int, int, int, float]], peak_tflops: float,
            wgrad_factor: float = 1.0) -> "GemmCurve":
        """Fit the curve to measured (m, n, k, TFLOP/s) points, by least squares on relative time error.

        Model of a measured time: t = F / (peak * max_efficiency) * (1 + half_dim * x) + t0, with
        F = 2mnk and x = 1/m + 1/n + 1/k; linear in (1/max_efficiency, half_dim/max_efficiency, t0).
        t0 absorbs a fixed cost per timed call: CUDA events around ONE kernel launched on an idle GPU
        also time the host's dispatch (~25 us in torch), which made the 1024^3 GEMM read 69 TFLOP/s.
        Without t0 the small shapes dragged the fit to a negative max_efficiency (a pole near x =
        1/2000, i.e. wildly wrong rates for every transformer shape).  t0 is NOT part of the curve:
        inside a training step the host runs ahead and kernels start back to back
        (ClusterSpec.kernel_launch_us keeps the per-kernel gap).
        """
        if not points:
            raise ValueError("GemmCurve.fit needs at least one measured GEMM")
        rows = []  # (features / t, 1): minimises the sum of squared relative errors
        for m, n, k, tflops in points:
            flops = 2.0 * m * n * k
            t = flops / (tflops * 1e12)
            base = flops / (peak_tflops * 1e12)
            rows.append((base / t, base * (1.0 / m + 1.0 / n + 1.0 / k) / t, 1.0 / t))
        for cols in ((0, 1, 2), (0, 1), (0,)):  # drop t0, then the shape term, if the fit makes them negative
            if len(points) < len(cols):
                continue
            sol = _least_squares([[r[c] for c in cols] for r in rows], [1.0] * len(rows))
            if sol is not None and sol[0] > 0 and all(v >= 0 for v in sol[1:]):
                inv_eff, slope = sol[0], (sol[1] if len(sol) > 1 else 0.0)
                return cls(peak_tflops, 1.0 / inv_eff, slope / inv_eff, wgrad_factor)
        raise ValueError(f"could not fit a GEMM curve to {points}")


def _least_squares(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve min |a x - b| through the normal equations (a few unknowns; no numpy dependency)."""
    n = len(a[0])
    ata = [[sum(r[i] * r[j] for r in a) for j in range(n)] for i in range(n)]
    atb = [sum(r[i] * y for r, y in zip(a, b)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, n), key=lambda r: abs(ata[r][col]))
        if abs(ata[piv][col]) < 1e-300:
            return None
        ata[col], ata[piv], atb[col], atb[piv] = ata[piv], ata[col], atb[piv], atb[col]
        for r in range(n):
            if r != col:
                f = ata[r][col] / ata[col][col]
                ata[r] = [x - f * y for x, y in zip(ata[r], ata[col])]
                atb[r] -= f * atb[col]
    return [atb[i] / ata[i][i] for i in range(n)]


@dataclass(frozen=True)
class ClusterSpec:
    """One kind of GPU in nodes of ``gpus_per_node``, with the links between them."""

    name: str
    gpus_per_node: int
    num_nodes: int
    memory_gib: float  # usable device memory per GPU
    gemm: GemmCurve
    copy_gbs: float  # device-to-device copy, bytes read + written per second (elementwise passes)
    attention_fwd_efficiency: float  # flash/SDPA causal attention, fraction of peak, forward
    attention_bwd_efficiency: float  # and backward (2.5x the forward FLOPs)
    intra_busbw_gbs: float  # NCCL bus bandwidth of ring collectives inside a node (NVLink)
    intra_p2p_gbs: float  # one-direction point-to-point bandwidth inside a node
    nic_gbs: float  # achieved inter-node bandwidth per GPU (one NIC per GPU), each direction
    intra_latency_us: float = 10.0  # per ring step inside a node
    inter_latency_us: float = 20.0  # per ring step across nodes
    kernel_launch_us: float = 4.0  # per GEMM / elementwise kernel; matters for small shapes
    # The host's (CPU's) time to launch one transformer layer's forward and backward for one microbatch, eager
    # PyTorch; where a rank's GPU work is shorter, its GPU waits for the host (0: not priced).
    host_layer_us: float = 0.0
    # Memory-bound kernels (norms, activations, adds, copies, reductions) as a fraction of copy_gbs.
    # 0.86: the byte-weighted mean of parallel3d's LayerNorm (87% fwd, 74% bwd), bias-GeLU (95%,
    # 93%) and bias-dropout-add (93%, 83%) kernels measured on H100 at GPT-1.3B sizes
    # (BENCHMARKS.md, "Fused kernels"); torch's own elementwise kernels land in the same range.
    elementwise_efficiency: float = 0.86
    optimizer_gbs: float = 0.0  # fused AdamW, 28 B/param over its time (calibrated); 0: elementwise rate
    context_gib: float = 2.0  # CUDA context, NCCL buffers, cuBLAS workspaces: outside max_memory_allocated
    fragmentation: float = 0.10  # caching-allocator reserve over the allocated peak (see docs/planning.md)
    # Whether a collective beside a GEMM runs during it. Not on Hopper: cuBLAS's persistent GEMMs hold every
    # SM until they end, so NCCL's kernel waits (BENCHMARKS.md, "Tensor parallelism: the link").
    comm_overlaps_gemm: bool = False
    # What an SP all-gather into NCCL symmetric windows (the copy engines, beside the GEMMs) still costs the
    # step, as a fraction of its time on NCCL's kernels: it shares the GEMMs' memory bandwidth. 1.0: not
    # measured here (no gain priced). Fitted from layouts_bench's tp2-sp-graph against tp2-sp-graph-plain.
    copy_engine_gather_cost: float = 1.0
    notes: str = ""

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def cluster_from_dict(d: dict) -> ClusterSpec:
    d = dict(d)
    gemm = d.pop("gemm")
    if "points" in gemm:  # a calibration file: fit the curve from its measured GEMMs
        curve = GemmCurve.fit([tuple(p) for p in gemm["points"]], gemm["peak_tflops"], gemm.get("wgrad_factor", 1.0))
    else:
        curve = GemmCurve(**gemm)
    known = {f.name for f in dataclasses.fields(ClusterSpec)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown cluster fields {unknown}; known: {sorted(known)}")
    return ClusterSpec(gemm=curve, **d)


def load_cluster(path: str) -> ClusterSpec:
    with open(path) as f:
        return cluster_from_dict(json.load(f))


# Dense bf16 datasheet peak per GPU (vendor datasheets): the MFU denominator training logs when
# --peak-tflops is not given, and the presets' curves' peak. Keyed by torch.cuda.get_device_name()
# exactly: "A10" must not match an A10G, nor an H100 PCIe the SXM part.
DATASHEET_PEAK_TFLOPS = {"NVIDIA H200": 989.4, "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0,
                         "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0,
                         "NVIDIA A100-PCIE-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA L40S": 362.0,
                         "NVIDIA A10": 125.0}


# H100 SXM: 989.4 TFLOP/s dense bf16.  The curve is GemmCurve.fit of the 12 GEMMs measured by
# bench/calibrate_planner.py on 2 x H100 80GB HBM3 (2026-11-26; bench/clusters/h100-sxm-2x.json):
# 776 TFLOP/s at 8192^3 (curve 780), 582-754 at GPT-1.3B's layer shapes.  The weight-gradient GEMM
# accumulated into fp32 ran at 0.98 of the plain one there (0.93-1.0 in BENCHMARKS.md's fused table).
_H100_GEMM = GemmCurve(peak_tflops=DATASHEET_PEAK_TFLOPS["NVIDIA H100 80GB HBM3"],
                       max_efficiency=0.813, half_dim=84.4, wgrad_factor=0.98)

# A100 SXM 80GB: 312 TFLOP/s dense bf16/fp16.  SC21 prints no GEMM benchmark, only that its
# best end-to-end runs reach 52% of peak (163 TFLOP/s).  ASSUMPTION: cuBLAS on A100 reaches the
# same fraction of peak by shape as we measured on H100 (79% at 8192^3, ~245 TFLOP/s), so the A100
# curve is the H100 curve scaled to 312.  ONE curve for all five models; nothing is fitted per row.
_A100_GEMM = GemmCurve(peak_tflops=DATASHEET_PEAK_TFLOPS["NVIDIA A100-SXM4-80GB"],
                       max_efficiency=0.813, half_dim=84.4, wgrad_factor=0.95)

_H100_COMMON = dict(
    memory_gib=79.1, gemm=_H100_GEMM,
    copy_gbs=2953.0,  # measured device-to-device copy of 1 GiB (calibration; 2.96 TB/s in BENCHMARKS.md)
    # SDPA flash, causal, b 4, 16 heads, s 2048, head dim 128, measured: 0.164 ms forward (420 TFLOP/s)
    # and 0.552 ms backward (311 TFLOP/s counting 2.5x the forward FLOPs).
    attention_fwd_efficiency=0.424, attention_bwd_efficiency=0.314,
    intra_busbw_gbs=328.0,  # measured 2-GPU NVLink all-reduce of 1 GiB, bus bandwidth
    intra_p2p_gbs=365.0,  # measured 1 GiB send rank 0 -> rank 1 (NVLink 4)
    # bench/gpt_bench.py --host-time, GPT-1.3B, 2 x H200 host, 2026-11-27 (BENCHMARKS.md, issue 26's third lease):
    # TP=2 + SP at micro-batch 4 took 405-412 ms of host time for 96 layer-microbatches, one GPU 433 ms.
    host_layer_us=4300.0,
)

# The pipeline split's price of the output layer and loss (compute.head_cost_in_layers): bytes of memory
# traffic worth one GEMM FLOP's time, and a layer's time over its GEMMs' alone. H100, GPT-1.3B, 2026-11-26:
# GEMMs at ~650 TFLOP/s against ~3 TB/s copies; a layer measured 4.9 ms forward + backward for 4.45 ms of
# GEMMs. Calibrated so that the loss path measured there gives the measured head: 3.8 layers (11.2 ms
# forward + 7.5 ms backward) at PP=4.
FLOPS_PER_LOSS_BYTE = 200.0
LAYER_OVER_GEMMS = 1.1
# Effective bytes the memory-bound loss moves per logit element, (forward, backward), at copy bandwidth, by
# whether it runs tensor-parallel, measured on H100 (BENCHMARKS.md): TP > 1, the vocab-parallel algorithm,
# whole (the last stage's forward and backward minus the logits GEMMs); TP = 1, the fused kernel
# (bench/kernels_bench.py; it reads a bf16 logit once forward, reads it and writes its gradient backward).
LOSS_BYTES_PER_LOGIT = {True: (64.0, 24.0), False: (2.2, 4.2)}

PRESETS: dict[str, ClusterSpec] = {
    "a100-80gb-sc21": ClusterSpec(
        name="a100-80gb-sc21", gpus_per_node=8, num_nodes=384, memory_gib=80.0, gemm=_A100_GEMM,
        copy_gbs=1700.0,  # 2.04 TB/s HBM2e at the ~83% a copy reaches
        attention_fwd_efficiency=0.30, attention_bwd_efficiency=0.25,
        intra_busbw_gbs=230.0,  # 600 GB/s NVLink = 300 GB/s each way; NCCL all-reduce reaches ~77%
        intra_p2p_gbs=250.0,
        nic_gbs=22.5,  # 8 x 200 Gb/s HDR per node = 25 GB/s per GPU, ~90% achieved
        comm_overlaps_gemm=True,  # Ampere's cuBLAS GEMMs launch waves of blocks: NCCL takes SMs between them
        notes="SC21 (Narayanan et al. 2021) Selene: DGX A100 80GB, NVLink 3, 8 x HDR InfiniBand per node"),
    "h100-sxm": ClusterSpec(name="h100-sxm", gpus_per_node=8, num_nodes=1, nic_gbs=45.0,
                            notes="one 8-GPU H100 SXM node; the figures of bench/clusters/h100-sxm-2x.json (2 GPUs)",
                            **_H100_COMMON),
    "h100-8x64": ClusterSpec(name="h100-8x64", gpus_per_node=8, num_nodes=64,
                             nic_gbs=45.0,  # 8 x 400 Gb/s NDR per node = 50 GB/s per GPU, ~90% achieved
                             notes="64 nodes of 8 H100 SXM, 8 x 400 Gb/s InfiniBand per node", **_H100_COMMON),
    "h200": ClusterSpec(name="h200", gpus_per_node=8, num_nodes=1, nic_gbs=45.0,
                        **{**_H100_COMMON, "memory_gib": 139.8, "copy_gbs": 4240.0, "intra_busbw_gbs": 325.0,
                           "intra_p2p_gbs": 219.0},  # measured on an H200 machine
                        notes="one 8-GPU H200 node: H100 compute, 141 GB HBM3e, copy 4.24 TB/s measured"),
}
PRESETS["h200-8x64"] = dataclasses.replace(PRESETS["h200"], name="h200-8x64", num_nodes=64,
                                           notes="64 nodes of 8 H200, 8 x 400 Gb/s InfiniBand per node")


def get_cluster(name: str) -> ClusterSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown cluster {name!r}; presets: {', '.join(sorted(PRESETS))} (or --cluster-file)")
    return PRESETS[name]


__all__ = ["GIB", "DATASHEET_PEAK_TFLOPS", "GemmCurve", "ClusterSpec", "PRESETS", "get_cluster", "load_cluster",
           "cluster_from_dict"]
