"""Per-microbatch compute and tensor-parallel communication time of each part of the model.

Times are for ONE tensor-parallel rank and one microbatch of ``micro_batch_size`` sequences:
- GEMMs: 2mnk FLOPs at the cluster's GemmCurve efficiency for that shape, but never faster
  than moving their operands through HBM (roofline), plus one kernel launch;
- flash attention: causal FLOPs (half the square) at the measured SDPA efficiency; the
  unfused (SC21-era) attention: two batched GEMMs over the full square plus the masked-softmax
  and dropout passes over the [b, heads, s, s] scores;
- norms, activations, bias-dropout-add, RoPE, embedding and the loss: bytes moved over the
  measured copy bandwidth (each counted as the fused kernels read and write them);
- TP (and SP) collectives of the layer, which Megatron and parallel3d do not overlap.
The backward splits into input-gradient and weight-gradient GEMMs; recompute adds the forward
(full) or the core attention (selective) to the backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from .comm import all_gather_time, all_reduce_time, group_of, reduce_scatter_time
from .hardware import ClusterSpec
from .model import Layout, ModelSpec

# Bytes moved per logit element by the vocab-parallel cross-entropy, forward and backward
# (fp32 upcast, max, shift, exp, sum, gather; then softmax minus one-hot and the cast back).
# Derived from the PP=2 stage times of BENCHMARKS.md: the last stage's forward was 11 ms longer
# than the first stage's for 8192 tokens x 50304 logits, of which ~2 ms is the logits GEMM.
LOSS_FWD_BYTES_PER_LOGIT = 64.0
LOSS_BWD_BYTES_PER_LOGIT = 24.0
FLASH_BWD_FLOP_RATIO = 2.5  # FlashAttention-2's backward: 5 matmuls against the forward's 2


@dataclass(frozen=True)
class PassCost:
    """Seconds per microbatch on one rank; tp_comm_* are included in neither compute field."""

    fwd: float = 0.0
    bwd_input: float = 0.0
    bwd_weight: float = 0.0
    recompute: float = 0.0  # forward work redone inside the backward
    tp_comm_fwd: float = 0.0
    tp_comm_bwd: float = 0.0  # includes the recomputed forward's collectives

    @property
    def forward(self) -> float:
        return self.fwd + self.tp_comm_fwd

    @property
    def backward(self) -> float:
        return self.bwd_input + self.bwd_weight + self.recompute + self.tp_comm_bwd

    @property
    def compute(self) -> float:
        return self.fwd + self.bwd_input + self.bwd_weight + self.recompute

    @property
    def tp_comm(self) -> float:
        return self.tp_comm_fwd + self.tp_comm_bwd

    def __add__(self, other: "PassCost") -> "PassCost":
        return PassCost(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def __mul__(self, k: float) -> "PassCost":
        return PassCost(*(a * k for a in self.astuple()))

    def astuple(self) -> tuple[float, ...]:
        return (self.fwd, self.bwd_input, self.bwd_weight, self.recompute, self.tp_comm_fwd, self.tp_comm_bwd)


def gemm_time(cluster: ClusterSpec, m: int, n: int, k: int, batch: int = 1, wgrad: bool = False,
              elem_bytes: int = 2) -> float:
    """One (batched) GEMM [m, k] x [k, n]; a weight gradient accumulates into an fp32 buffer."""
    g = cluster.gemm
    eff = g.efficiency(m, n, k) * (g.wgrad_factor if wgrad else 1.0)
    flops = 2.0 * m * n * k * batch
    out_bytes = 8 if wgrad else elem_bytes  # fp32 main_grad is read and written
    moved = batch * ((m * k + k * n) * elem_bytes + m * n * out_bytes)
    return max(flops / (g.peak_tflops * 1e12 * eff), moved / (cluster.copy_gbs * 1e9)) + cluster.kernel_launch_us * 1e-6


def _linear(cluster: ClusterSpec, tokens: int, n_out: int, k_in: int, elem: int) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of y[tokens, n_out] = x[tokens, k_in] W^T."""
    return (gemm_time(cluster, tokens, n_out, k_in, elem_bytes=elem),
            gemm_time(cluster, tokens, k_in, n_out, elem_bytes=elem),
            gemm_time(cluster, n_out, k_in, tokens, wgrad=True, elem_bytes=elem))


def _passes(cluster: ClusterSpec, nbytes: float, kernels: int) -> float:
    return nbytes / (cluster.copy_gbs * 1e9) + kernels * cluster.kernel_launch_us * 1e-6


def _attention_core(model: ModelSpec, layout: Layout, cluster: ClusterSpec, elem: int) -> tuple[float, float]:
    """(forward, backward) seconds of softmax(QK^T)V for this rank's heads."""
    b, s, d = layout.micro_batch_size, model.seq_length, model.head_dim
    heads = model.num_attention_heads // layout.tp
    peak = cluster.gemm.peak_tflops * 1e12
    if model.attention_backend == "flash":
        flops = 4.0 * b * heads * s * s * d / 2  # causal: the kernel skips the masked half
        launch = cluster.kernel_launch_us * 1e-6
        return (flops / (peak * cluster.attention_fwd_efficiency) + launch,
                FLASH_BWD_FLOP_RATIO * flops / (peak * cluster.attention_bwd_efficiency) + 2 * launch)
    # Unfused: the full square is computed and masked (Megatron's scaled_upper_triang_masked_softmax).
    bmm = gemm_time(cluster, s, s, d, batch=b * heads, elem_bytes=elem) + \
        gemm_time(cluster, s, d, s, batch=b * heads, elem_bytes=elem)
    scores = b * heads * s * s
    dropout = layout_dropout(model)
    fwd_bytes = scores * (2 * elem + (2 * elem + 1 if dropout else 0))
    bwd_bytes = scores * (3 * elem + (2 * elem + 1 if dropout else 0))
    return bmm + _passes(cluster, fwd_bytes, 2), 2 * bmm + _passes(cluster, bwd_bytes, 2)


def layout_dropout(model: ModelSpec) -> bool:
    return model.hidden_dropout > 0


def layer_cost(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> PassCost:
    """One transformer layer, one microbatch, one TP rank."""
    t, elem = layout.tp, 2 if layout.bf16 else 4
    h, tokens = model.hidden_size, layout.micro_batch_size * model.seq_length
    sp_tokens = tokens // t if layout.sequence_parallel else tokens  # norms and dropout under SP
    linears = [
        _linear(cluster, tokens, (model.q_size + 2 * model.kv_size) // t, h, elem),  # linear_qkv
        _linear(cluster, tokens, h, model.q_size // t, elem),  # linear_proj
        _linear(cluster, tokens, model.fc1_out // t, h, elem),  # linear_fc1
        _linear(cluster, tokens, h, model.ffn // t, elem),  # linear_fc2
    ]
    fwd = sum(f for f, _, _ in linears)
    bwd_in = sum(i for _, i, _ in linears)
    bwd_w = sum(w for _, _, w in linears)
    attn_f, attn_b = _attention_core(model, layout, cluster, elem)

    mask = 0.5 if layout_dropout(model) else 0.0  # a 1-byte mask per element, in units of bf16 elements
    rope = 2 * (model.q_size + model.kv_size) // t if model.position_embedding_type == "rope" else 0
    # Forward: 2 norms (read, write), 2 bias-dropout-adds (x, residual -> out), activation, RoPE.
    ew_fwd = sp_tokens * h * (2 + 2 + 2 * (3 + mask)) + tokens * ((model.fc1_out + model.ffn) // t + rope)
    # Backward: norms read x and dy and write dx; dropout-add reads dy (and mask), writes 2 grads.
    ew_bwd = sp_tokens * h * (3 + 3 + 2 * (3 + mask)) + tokens * ((2 * model.fc1_out + model.ffn) // t + rope)
    fwd += attn_f + _passes(cluster, ew_fwd * elem, 6)
    bwd_in += attn_b + _passes(cluster, ew_bwd * elem, 8)

    if layout.recompute_granularity == "full":
        recompute = fwd
    elif layout.recompute_granularity == "selective":
        recompute = attn_f
    else:
        recompute = 0.0

    tp_group = group_of(cluster, t, 1)
    act = tokens * h * elem
    if layout.sequence_parallel:  # 2 all-gathers + 2 reduce-scatters each way
        one_way = 2 * (all_gather_time(cluster, tp_group, act) + reduce_scatter_time(cluster, tp_group, act))
    else:  # 2 all-reduces each way (after the row-parallel forward, before the column-parallel backward)
        one_way = 2 * all_reduce_time(cluster, tp_group, act)
    comm_bwd = one_way * (2 if layout.recompute_granularity == "full" else 1)
    return PassCost(fwd, bwd_in, bwd_w, recompute, one_way, comm_bwd)


def embedding_cost(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> PassCost:
    """Word (+ position) embedding lookup; its gradient is scattered into the fp32 main_grad."""
    t, elem = layout.tp, 2 if layout.bf16 else 4
    tokens, h = layout.micro_batch_size * model.seq_length, model.hidden_size
    fwd = _passes(cluster, tokens * h * elem * 3, 2)
    bwd = _passes(cluster, tokens * h * (elem + 8), 2)
    group = group_of(cluster, t, 1)
    comm = (reduce_scatter_time(cluster, group, tokens * h * elem) if layout.sequence_parallel
            else all_reduce_time(cluster, group, tokens * h * elem))
    return PassCost(fwd=fwd, bwd_weight=bwd, tp_comm_fwd=comm)


def head_cost(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> PassCost:
    """Final norm, output layer and vocab-parallel cross-entropy (never recomputed)."""
    t, elem = layout.tp, 2 if layout.bf16 else 4
    tokens, h = layout.micro_batch_size * model.seq_length, model.hidden_size
    sp_tokens = tokens // t if layout.sequence_parallel else tokens
    vocab = model.vocab(t) // t
    f, i, w = _linear(cluster, tokens, vocab, h, elem)
    logits = tokens * vocab
    fwd = f + _passes(cluster, sp_tokens * h * 2 * elem + logits * LOSS_FWD_BYTES_PER_LOGIT, 8)
    bwd_in = i + _passes(cluster, sp_tokens * h * 3 * elem + logits * LOSS_BWD_BYTES_PER_LOGIT, 4)
    group = group_of(cluster, t, 1)
    act = tokens * h * elem
    if layout.sequence_parallel:
        comm_f, comm_b = all_gather_time(cluster, group, act), reduce_scatter_time(cluster, group, act)
    else:
        comm_f, comm_b = 0.0, all_reduce_time(cluster, group, act)
    comm_f += 3 * all_reduce_time(cluster, group, tokens * 4)  # the loss's max / sum / target logit
    return PassCost(fwd, bwd_in, w, 0.0, comm_f, comm_b)


def optimizer_time(params_on_rank: int, layout: Layout, cluster: ClusterSpec) -> float:
    """Memory-bound optimizer step (Adam), per rank.

    Every rank zeroes its whole fp32 gradient buffer (4 B/param); on the shard it steps
    (1/DP of it under ZeRO-1): the norm reads the gradient (4), Adam reads master, grad, m, v
    and writes master, m, v (28), and bf16 training copies the master into the bf16 param (6).
    """
    shard = params_on_rank / (layout.dp if layout.use_distributed_optimizer else 1)
    per_shard = 4 + 28 + (6 if layout.bf16 else 0)
    return _passes(cluster, 4 * params_on_rank + per_shard * shard, 12)
