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
from .hardware import FLOPS_PER_LOSS_BYTE, LAYER_OVER_GEMMS, LOSS_BYTES_PER_LOGIT, ClusterSpec
from .model import Layout, ModelSpec

FLASH_BWD_FLOP_RATIO = 2.5  # FlashAttention-2's backward: 5 matmuls against the forward's 2



def head_cost_in_layers(hidden_size: int, seq_length: int, padded_vocab_size: int,
                        tensor_parallel: bool = False) -> float:
    """The output layer and loss in units of one transformer layer's training time (what the balanced pipeline
    split puts on the last stage). Layer: 72 b s h^2 + 12 b s^2 h GEMM FLOPs (QKV, projection, a 4h MLP, the
    scores; forward plus backward = 3x forward) x LAYER_OVER_GEMMS; output layer: 6 b s h V FLOPs plus the
    loss's passes over the b s V logits (LOSS_BYTES_PER_LOGIT at FLOPS_PER_LOSS_BYTE, hardware's tables)."""
    h, s, V = hidden_size, seq_length, padded_vocab_size
    loss_bytes = sum(LOSS_BYTES_PER_LOGIT[tensor_parallel])
    return (6 * h * V + loss_bytes * V * FLOPS_PER_LOSS_BYTE) / ((72 * h * h + 12 * s * h) * LAYER_OVER_GEMMS)


@dataclass(frozen=True)
class PassCost:
    """Seconds per microbatch on one rank; tp_comm_* are included in neither compute field."""

    fwd: float = 0.0
    bwd_input: float = 0.0
    bwd_weight: float = 0.0
    recompute: float = 0.0  # forward work redone inside the backward
    tp_comm_fwd: float = 0.0
    tp_comm_bwd: float = 0.0  # includes the recomputed forward's collectives
    host: float = 0.0  # the host's time to launch the forward and backward (the GPU waits where it is longer)

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
        return (self.fwd, self.bwd_input, self.bwd_weight, self.recompute, self.tp_comm_fwd, self.tp_comm_bwd,
                self.host)


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
    """Memory-bound kernels moving ``nbytes``, at the fraction of copy bandwidth such kernels reach."""
    return nbytes / (cluster.copy_gbs * 1e9 * cluster.elementwise_efficiency) + kernels * cluster.kernel_launch_us * 1e-6


def _loss_passes(cluster: ClusterSpec, nbytes: float, kernels: int) -> float:
    """The loss's passes: planning.hardware.LOSS_BYTES_PER_LOGIT gives effective bytes at copy bandwidth."""
    return nbytes / (cluster.copy_gbs * 1e9) + kernels * cluster.kernel_launch_us * 1e-6


def _attention_core(model: ModelSpec, layout: Layout, cluster: ClusterSpec, elem: int) -> tuple[float, float]:
    """(forward, backward) seconds of softmax(QK^T)V for this rank's heads."""
    b, s, d = layout.micro_batch_size, model.seq_length, model.head_dim
    heads = model.num_attention_heads // layout.tp
    peak = cluster.gemm.peak_tflops * 1e12
    if model.attention_backend == "sdpa":
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


def _exposed(cluster: ClusterSpec, comm: float, gemm: float) -> float:
    """Exposed part of a collective started (async_op=True) before a GEMM and waited for after it.

    LinearWithGradAccumulationAndAsyncCommunication.backward (tensor_parallel/linear_functions.py) does
    this twice in a column-parallel linear: under SP, the input's all-gather (for the weight gradient)
    runs beside the input-gradient GEMM; then the input gradient's reduce-scatter (all-reduce without
    SP) runs beside the weight-gradient GEMM. Where the GEMMs are persistent (``comm_overlaps_gemm``
    False: cuBLAS on Hopper holds every SM until it ends), the collective waits for the GEMM and is
    all exposed (BENCHMARKS.md, "Tensor parallelism: the link").
    """
    return max(0.0, comm - gemm) if cluster.comm_overlaps_gemm else comm


def layer_cost(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> PassCost:
    """One transformer layer, one microbatch, one TP rank."""
    t, elem = layout.tp, 2 if layout.bf16 else 4
    h, tokens = model.hidden_size, layout.micro_batch_size * model.seq_length
    qkv, q = (model.q_size + 2 * model.kv_size) // t, model.q_size // t
    linears = [
        _linear(cluster, tokens, qkv, h, elem),  # linear_qkv
        _linear(cluster, tokens, h, q, elem),  # linear_proj
        _linear(cluster, tokens, model.fc1_out // t, h, elem),  # linear_fc1
        _linear(cluster, tokens, h, model.ffn // t, elem),  # linear_fc2
    ]
    fwd = sum(f for f, _, _ in linears)
    bwd_in = sum(i for _, i, _ in linears)
    bwd_w = sum(w for _, _, w in linears)
    attn_f, attn_b = _attention_core(model, layout, cluster, elem)
    fwd += attn_f + _passes(cluster, _layer_elementwise(model, layout, forward=True) * elem, 10)
    bwd_in += attn_b + _passes(cluster, _layer_elementwise(model, layout, forward=False) * elem, 16)

    if layout.recompute_granularity == "full":
        recompute = fwd
    elif layout.recompute_granularity == "selective":
        recompute = attn_f
    else:
        recompute = 0.0

    tp_group = group_of(cluster, t, 1)
    act = tokens * h * elem
    (_, dgrad_qkv, wgrad_qkv), (_, dgrad_fc1, wgrad_fc1) = linears[0], linears[2]  # the column-parallel GEMMs
    if layout.sequence_parallel:
        ag, rs = all_gather_time(cluster, tp_group, act), reduce_scatter_time(cluster, tp_group, act)
        # Forward: all-gather into linear_qkv and linear_fc1, reduce-scatter out of linear_proj and
        # linear_fc2.  Backward: the reduce-scatters' adjoints are all-gathers of the gradient; the
        # column-parallel linears all-gather their input again for the weight gradient (it is not
        # kept) beside their input-gradient GEMM, whose reduce-scatter overlaps the weight-gradient GEMM.
        gather_in = (ag, ag, _exposed(cluster, ag, dgrad_qkv), _exposed(cluster, ag, dgrad_fc1))
        out_rs, grad_ag = rs, ag  # the row-parallel outputs' reduce-scatters and their gradients' gathers
        grad_rs = _exposed(cluster, rs, wgrad_qkv) + _exposed(cluster, rs, wgrad_fc1)  # the input gradients'
        if layout.symmetric_gathers:  # all eight in the windows, each beside a split GEMM (linear_functions.py)
            ce = cluster.copy_engine_gather_cost  # the gathers on the copy engines
            gather_in, grad_ag = (ag * ce,) * 4, ag * ce
            if t == 2:  # a reduce-scatter's exchange is a gather of the peer's piece; above TP=2 it is an
                # all-to-all, which gained a fifth of what TP=2 did (BENCHMARKS.md, tenth lease): NCCL's time
                out_rs, grad_rs = rs * ce, 2 * rs * ce
        comm_fwd = gather_in[0] + gather_in[1] + 2 * out_rs
        comm_bwd = 2 * grad_ag + gather_in[2] + gather_in[3] + grad_rs
    else:
        ar = all_reduce_time(cluster, tp_group, act)
        # Forward: the row-parallel outputs (linear_proj, linear_fc2) are all-reduced, synchronously.
        # Backward: the column-parallel input gradients are all-reduced behind the weight gradient.
        comm_fwd = 2 * ar
        comm_bwd = _exposed(cluster, ar, wgrad_qkv) + _exposed(cluster, ar, wgrad_fc1)
    if layout.recompute_granularity == "full":
        comm_bwd += comm_fwd  # the recomputed forward communicates again
    # The host's launches: eager, or (CUDA graphs) one replay for the forward and one for the backward
    host = 2 * cluster.kernel_launch_us if layout.enable_cuda_graph else cluster.host_layer_us
    return PassCost(fwd, bwd_in, bwd_w, recompute, comm_fwd, comm_bwd, host * 1e-6)


def _layer_elementwise(model: ModelSpec, layout: Layout, forward: bool) -> float:
    """Elements read + written by one layer's non-GEMM kernels on one TP rank, as models/gpt.py runs them.

    Counted pass by pass from the code (every tensor read once and written once per kernel):
    [hidden]-wide tensors cover sp_tokens under SP, TP-split ones the full tokens.
    """
    t = layout.tp
    h, tokens = model.hidden_size, layout.micro_batch_size * model.seq_length
    rows = tokens // t if layout.sequence_parallel else tokens
    qkv, q = (model.q_size + 2 * model.kv_size) // t, model.q_size // t
    fc1, ffn = model.fc1_out // t, model.ffn // t
    mask = 0.5 if layout_dropout(model) else 0.0  # a 1-byte mask per element, in units of bf16 elements
    rope = 2 * (model.q_size + model.kv_size) // t if model.position_embedding_type == "rope" else 0
    bias = model.add_bias_linear
    if forward:
        n = rows * h * 2 * 2  # input_layernorm and pre_mlp_layernorm: read x, write y
        n += rows * h * 2 * (3 + mask)  # two bias-dropout-adds: read x and the residual, write out (+ mask)
        n += tokens * (fc1 + ffn)  # bias-activation: read fc1's output, write the activation
        n += tokens * rope  # RoPE on q and k
        # core attention's [b, n, s, d] output permuted back to [s, b, n*d]: a copy with the local backend and
        # flash; cuDNN's SDPA (H100's default) writes it in that layout already, a pass counted here regardless
        n += tokens * q * 2
        if t > 1 and not layout.sequence_parallel:  # _ReduceFromRegion clones linear_proj's and linear_fc2's
            n += tokens * h * 2 * 2  # output before their in-place all-reduces
        return n
    n = rows * h * 2 * 4  # two norm backwards: read x, dy and the residual's gradient, write dx (the kernel
    # sums the residual's gradient into dx: fused.layer_norm_with_residual, no separate autograd add)
    n += rows * h * 2 * (3 + mask)  # two bias-dropout-add backwards (grad, bias-grad reduction, mask)
    n += tokens * (2 * fc1 + ffn)  # activation backward: read dy and x, write dx (and the fc1 bias gradient
    # from the same pass: the fused kernel's partial sums in registers)
    n += tokens * q * 2  # the attention output's gradient made contiguous (as forward: not under cuDNN's SDPA)
    n += tokens * qkv * 2  # dq, dk, dv into linear_qkv's [s, b, qkv] gradient: fused.split_qkv's backward (a
    # concatenation that also sums linear_qkv's bias gradient), or with RoPE fused.split_qkv_rope's backward,
    # which rotates dq and dk in the same pass; after that one, linear_qkv sums its bias's gradient (one read)
    n += tokens * qkv if bias and rope else 0
    return n


def _embedding_grad_bytes(model: ModelSpec, layout: Layout, rows: int) -> float:
    """Bytes one microbatch moves to deliver the [rows, hidden] word-embedding gradient into main_grad.

    The lookup's backward adds the looked-up rows' gradients into the fp32 main_grad (read elem, widened
    to fp32: write and read 4, main_grad's rows read and written 8; linear_functions.embedding). A weight
    tied to the output layer of the same chunk (one stage) keeps nn.Embedding's backward instead, for the
    DDP hook to add: a dense zero-initialised [rows, h] gradient (write elem, scatter), added into main_grad
    (read 4 + elem, write 4). The output layer's wgrad went into main_grad either way.
    """
    elem = 2 if layout.bf16 else 4
    if not model.untie_embeddings_and_output_weights and layout.pp == 1:
        return rows * model.hidden_size * (elem + 8 + elem)
    return layout.micro_batch_size * model.seq_length * model.hidden_size * (elem + 8 + 8)


def embedding_cost(model: ModelSpec, layout: Layout, cluster: ClusterSpec) -> PassCost:
    """Word (+ position) embedding lookup and its dense weight gradient added into main_grad."""
    t, elem = layout.tp, 2 if layout.bf16 else 4
    tokens, h = layout.micro_batch_size * model.seq_length, model.hidden_size
    # Lookup (+ position lookup and add), the [b, s, h] -> [s, b, h] transpose copy, and above TP=1 the
    # clone of _ReduceFromRegion before the TP sum.
    clone = 1 if t > 1 else 0
    fwd = _passes(cluster, tokens * h * elem * (3 + 2 + 2 * clone), 3 + clone)
    bwd = _passes(cluster, _embedding_grad_bytes(model, layout, model.vocab(t) // t) + tokens * h * elem, 3)
    group = group_of(cluster, t, 1)
    rope = model.position_embedding_type == "rope"  # only then is the TP sum a reduce-scatter (gpt.py)
    comm = (reduce_scatter_time(cluster, group, tokens * h * elem) if layout.sequence_parallel and rope
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
    loss_fwd, loss_bwd = LOSS_BYTES_PER_LOGIT[t > 1]
    fwd = f + _passes(cluster, sp_tokens * h * 2 * elem, 2) + _loss_passes(cluster, logits * loss_fwd, 6)
    bwd_in = i + _passes(cluster, sp_tokens * h * 3 * elem, 2) + _loss_passes(cluster, logits * loss_bwd, 4)
    # A tied output weight costs nothing more: its wgrad goes into main_grad like any linear's, and it returns
    # no gradient beside the embedding's (which embedding_cost counts) or an uninitialised one the hook skips.
    group = group_of(cluster, t, 1)
    act = tokens * h * elem
    if layout.sequence_parallel:  # all-gather in; backward: all-gather again behind the dgrad, RS behind the wgrad
        comm_f = all_gather_time(cluster, group, act)
        comm_b = _exposed(cluster, comm_f, i) + _exposed(cluster, reduce_scatter_time(cluster, group, act), w)
    else:  # the output layer's input-gradient all-reduce hides behind its weight-gradient GEMM
        comm_f, comm_b = 0.0, _exposed(cluster, all_reduce_time(cluster, group, act), w)
    comm_f += 3 * all_reduce_time(cluster, group, tokens * 4)  # the loss's max / sum / target logit
    return PassCost(fwd, bwd_in, w, 0.0, comm_f, comm_b)


def optimizer_time(params_on_rank: int, layout: Layout, cluster: ClusterSpec) -> float:
    """Memory-bound work of one step outside the microbatches, per rank (training.train_step).

    Counted from the code, in bytes per parameter:
    - the fp32 main_grad buffer is zeroed once, 4 (optimizer.zero_grad() at the step's start);
    - with DP > 1 each bucket is scaled by 1/DP before its reduction, read 4 + write 4;
    - on the shard it steps (1/DP of the parameters under ZeRO-1): the gradient norm reads the
      gradient (4) and fused Adam reads master, grad, m, v and writes master, m, v (28; at
      ``optimizer_gbs`` where calibrated);
    - without ZeRO-1, our one-pass AdamW (fused.adamw_master_step) takes the clip as its gradient
      scale and writes the bf16 parameter beside its master (2 more in the same pass);
    - under ZeRO-1 the three run apart: clipping scales the gradient in place (8: --clip-grad 1.0
      fires while the norm is above 1, early in training and in the benchmarks; assumed), torch's
      fused Adam, and bf16 training's copy of the master into the bf16 parameter (6).
    """
    shard = params_on_rank / (layout.dp if layout.use_distributed_optimizer else 1)
    other = 4 * params_on_rank + (8 * params_on_rank if layout.dp > 1 else 0)
    one_pass = not layout.use_distributed_optimizer
    other += (4 + (0 if one_pass else 8 + (6 if layout.bf16 else 0))) * shard
    adam = 28 + (2 if one_pass and layout.bf16 else 0)
    adam_gbs = cluster.optimizer_gbs or cluster.copy_gbs * cluster.elementwise_efficiency
    return _passes(cluster, other, 12) + adam * shard / (adam_gbs * 1e9)
