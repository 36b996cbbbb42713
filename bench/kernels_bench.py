"""Time parallel3d's fused CUDA kernels against torch eager, torch.compile and Liger-Kernel.

    python3 bench/kernels_bench.py [--out bench.md] [--quick] [--only norm,rope]

For every op, at real sizes in bf16, forward and backward are timed separately
(median of triton.testing.do_bench, CUDA events).  Backward is
``torch.autograd.grad`` on a retained graph, the same way for every
implementation.  Achieved bandwidth counts the fewest bytes the pass must move
(each input read once, each output written once) and is reported as a fraction
of the card's device-to-device copy bandwidth, measured in the same run.  The
gradient-accumulation fusion is compared with the unfused GEMM-to-temporary +
add.  Prints a markdown table (and writes it to --out).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallel3d.fused as fused  # noqa: E402
from parallel3d.fused import _ext  # noqa: E402

try:
    from triton.testing import do_bench
except ImportError:  # pragma: no cover - triton ships with CUDA torch
    do_bench = None

try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    HAVE_LIGER = True
except Exception as e:  # noqa: BLE001 - any import problem means "no liger column"
    HAVE_LIGER = False
    LIGER_ERROR = repr(e)

DT = torch.bfloat16
ESZ = 2  # bytes per bf16 element


DEV = "cuda"


def bench_ms(fn) -> float:
    if DEV != "cuda":  # --tiny on a machine without a GPU: only checks that the script runs
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = (1 << 29) if DEV == "cuda" else (1 << 20)  # 512 MiB per buffer
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3)


# ---- eager references (what Megatron runs without fusion) -----------------------------------

def eager_bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


def eager_bias_gelu_erf(x, b):
    return F.gelu(x + b)


def eager_swiglu(x):
    a, g = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * g


def eager_bda(x, b, r):
    return r + F.dropout(x + b, p=0.1, training=True)


def eager_layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def eager_rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)


def eager_rope(t, freqs):
    rot = freqs.shape[-1]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(t_rot, 2, dim=-1)
    out = t_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, t_pass), dim=-1) if t_pass.shape[-1] else out


def eager_causal_softmax(x, scale):
    s = x.shape[-1]
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x * scale).masked_fill(mask, float("-inf")).float(), dim=-1).to(x.dtype)


def eager_cross_entropy(x, t):
    return F.cross_entropy(x.float(), t, reduction="none")


_compiled: dict = {}


def compiled(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


# ---- timing one case ------------------------------------------------------------------------

class Case:
    def __init__(self, op, shape, fwd_bytes, bwd_bytes, impls, make_inputs, grad_idx):
        self.op, self.shape = op, shape
        self.fwd_bytes, self.bwd_bytes = fwd_bytes, bwd_bytes
        self.impls = impls  # name -> callable(*inputs) -> tensor
        self.make_inputs = make_inputs
        self.grad_idx = grad_idx


def time_impl(fn, inputs, grad_idx):
    """(forward ms, backward ms) for fn on inputs; backward w.r.t. inputs[grad_idx]."""
    args = [a.detach().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a for i, a in enumerate(inputs)]
    fwd = bench_ms(lambda: fn(*args))
    if not grad_idx:
        return fwd, None
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    dys = [torch.randn_like(o) for o in outs]
    wrt = [args[i] for i in grad_idx]
    bwd = bench_ms(lambda: torch.autograd.grad(outs, wrt, dys, retain_graph=True))
    return fwd, bwd


def run_case(case: Case, copy_bw: float, rows: list, log):
    inputs = case.make_inputs()
    res = {}
    for name, impl in case.impls.items():
        # An impl is fn, or (fn, make_inputs, grad_idx) when it wants its own input layout.
        fn, ins, gidx = impl if isinstance(impl, tuple) else (impl, None, case.grad_idx)
        try:
            res[name] = time_impl(fn, ins() if ins else inputs, gidx)
        except Exception as e:  # noqa: BLE001 - a peer failing must not stop the run
            log(f"  {case.op} {case.shape} {name}: failed: {type(e).__name__}: {str(e)[:300]}")
            res[name] = (None, None)
    for p, nbytes in (("fwd", case.fwd_bytes), ("bwd", case.bwd_bytes)):
        k = 0 if p == "fwd" else 1
        ours = res.get("ours", (None, None))[k]
        if ours is None and nbytes is None:
            continue
        peers = {n: v[k] for n, v in res.items() if n != "ours"}
        finite = [v for v in peers.values() if v is not None]
        best = min(finite) if finite else None
        gbs = nbytes / (ours * 1e-3) / 1e9 if ours else None
        rows.append({
            "op": case.op, "shape": case.shape, "pass": p, "ours": ours, **{f"p_{n}": v for n, v in peers.items()},
            "gbs": gbs, "frac": (nbytes / (ours * 1e-3)) / copy_bw if ours else None,
            "speedup": best / ours if (best and ours) else None,
        })
        log(f"  {case.op:<24} {case.shape:<26} {p}: ours {fmt(ours)} ms, "
            + ", ".join(f"{n} {fmt(v)}" for n, v in peers.items())
            + (f", {gbs:.0f} GB/s = {100 * rows[-1]['frac']:.0f}% of copy" if gbs else ""))


def fmt(v, nd=3):
    return "n/a" if v is None else f"{v:.{nd}f}"


# ---- the cases -------------------------------------------------------------------------------

def cases(quick: bool, tiny: bool):
    """Sizes of LLaMA/GPT-class layers: 16384 tokens (seq 4096 x micro-batch 4), hidden 2048..8192."""
    dev = DEV
    tokens = 64 if tiny else 16384
    if tiny:
        quick = True
    out = []

    def rn(*s, dtype=DT):
        return torch.randn(*s, device=dev, dtype=torch.float32).to(dtype)

    for h in ((64 if tiny else 4096,) if quick else (2048, 4096, 8192)):
        n = tokens * h
        impls = {"ours": lambda x, w: fused.rms_norm(x, w, 1e-5), "eager": eager_rms_norm, "compile": compiled(eager_rms_norm)}
        if HAVE_LIGER:
            impls["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", False)
        out.append(Case("rms_norm", f"[{tokens}, {h}]", 2 * n * ESZ, 3 * n * ESZ, impls,
                        lambda h=h: [rn(tokens, h), rn(h)], [0, 1]))
        impls = {"ours": lambda x, w, b: fused.layer_norm(x, w, b, 1e-5), "eager": eager_layer_norm,
                 "compile": compiled(eager_layer_norm)}
        if HAVE_LIGER:
            impls["liger"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
        out.append(Case("layer_norm", f"[{tokens}, {h}]", 2 * n * ESZ, 3 * n * ESZ, impls,
                        lambda h=h: [rn(tokens, h), rn(h), rn(h)], [0, 1, 2]))

    for ffn in ((256 if tiny else 16384,) if quick else (8192, 16384)):
        n = tokens * ffn
        out.append(Case("bias_gelu (tanh)", f"[{tokens}, {ffn}]", 2 * n * ESZ, 3 * n * ESZ,
                        {"ours": lambda x, b: fused.bias_gelu(x, b, "tanh"), "eager": eager_bias_gelu,
                         "compile": compiled(eager_bias_gelu)},
                        lambda ffn=ffn: [rn(tokens, ffn), rn(ffn)], [0, 1]))
        out.append(Case("bias_gelu (erf)", f"[{tokens}, {ffn}]", 2 * n * ESZ, 3 * n * ESZ,
                        {"ours": lambda x, b: fused.bias_gelu(x, b, "none"), "eager": eager_bias_gelu_erf,
                         "compile": compiled(eager_bias_gelu_erf)},
                        lambda ffn=ffn: [rn(tokens, ffn), rn(ffn)], [0, 1]))

    for f in ((96 if tiny else 11008,) if quick else (11008, 14336)):
        n = tokens * f
        impls = {"ours": lambda x: fused.bias_swiglu(x, None), "eager": eager_swiglu, "compile": compiled(eager_swiglu)}
        if HAVE_LIGER:
            impls["liger"] = lambda x: LigerFusedGateUpSiLUMulFunction.apply(x)
        out.append(Case("swiglu (no bias)", f"[{tokens}, 2x{f}]", 3 * n * ESZ, 5 * n * ESZ, impls,
                        lambda f=f: [rn(tokens, 2 * f)], [0]))

    for h in ((64 if tiny else 4096,) if quick else (4096, 8192)):
        n = tokens * h
        out.append(Case("bias_dropout_add p=0.1", f"[{tokens}, {h}]", 3 * n * ESZ, 2 * n * ESZ,
                        {"ours": lambda x, b, r: fused.bias_dropout_add(x, b, r, 0.1, True), "eager": eager_bda,
                         "compile": compiled(eager_bda)},
                        lambda h=h: [rn(tokens, h), rn(h), rn(tokens, h)], [0, 1, 2]))

    for s, b, heads in ((((16, 2, 2) if tiny else (4096, 4, 32)),) if quick else ((4096, 4, 32), (8192, 2, 64))):
        d = 128
        n = s * b * heads * d  # elements of q (k the same)

        def make(s=s, b=b, heads=heads):
            q, k = rn(s, b, heads, d), rn(s, b, heads, d)
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
            f = torch.outer(torch.arange(s, device=dev, dtype=torch.float32), inv)
            emb = torch.cat((f, f), -1)
            return [q, k, emb[:, None, None, :].contiguous(), emb.cos().to(DT), emb.sin().to(DT)]

        impls = {
            "ours": lambda q, k, fr, c, si: fused.apply_rotary_pos_emb_qk(q, k, fr),
            "eager": lambda q, k, fr, c, si: (eager_rope(q, fr), eager_rope(k, fr)),
            "compile": compiled(lambda q, k, fr, c, si: (eager_rope(q, fr), eager_rope(k, fr))),
        }
        if HAVE_LIGER:
            # Liger's own layout: HF's [b, h, s, d] views of [b, s, h, d] storage (no copy inside).
            def make_liger(s=s, b=b, heads=heads):
                q, k, fr, c, si = make(s, b, heads)
                return [q.view(b, s, heads, d).transpose(1, 2), k.view(b, s, heads, d).transpose(1, 2), c, si]

            impls["liger"] = (lambda q, k, c, si: LigerRopeFunction.apply(q, k, c, si), make_liger, [0, 1])
        out.append(Case("rope q+k (sbhd)", f"2x[{s}, {b}, {heads}, {d}]", 4 * n * ESZ, 4 * n * ESZ, impls, make, [0, 1]))

    # linear_qkv's output [s, b, ng, (qpg + 2) d] split into q, k, v and q, k rotated (LLaMA's grouped query
    # attention): the fewest bytes are q and k read and written forward, the three gradients read and one
    # tensor written backward. "split+rope" is the model's path before split_qkv_rope (our RoPE kernel).
    qkv_shapes = ((4096, 2, 8, 4, 64), (8192, 1, 8, 4, 128))
    for s, b, ng, qpg, d in (((16, 2, 2, 2, 16) if tiny else qkv_shapes[0],) if quick else qkv_shapes):
        n = s * b * ng * d  # elements of k (and of v)

        def make_qkv(s=s, b=b, ng=ng, qpg=qpg, d=d):
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
            f = torch.outer(torch.arange(s, device=dev, dtype=torch.float32), inv)
            return [rn(s, b, ng, (qpg + 2) * d), torch.cat((f, f), -1)[:, None, None, :].contiguous()]

        def split(m, qpg=qpg, d=d):
            q, k, v = torch.split(m, [qpg * d, d, d], dim=3)
            return q.reshape(*q.shape[:2], -1, d), k, v

        def split_then_rope(m, fr, split=split):  # bound now: the next shape's loop redefines split
            q, k, v = split(m)
            return (*fused.apply_rotary_pos_emb_qk(q, k, fr), v)

        def eager_qkv(m, fr, split=split):
            q, k, v = split(m)
            return eager_rope(q, fr), eager_rope(k, fr), v

        impls = {"ours": lambda m, fr, qpg=qpg, d=d: fused.split_qkv_rope(m, qpg, d, fr),
                 "split+rope": split_then_rope, "eager": eager_qkv, "compile": compiled(eager_qkv)}
        out.append(Case("qkv split + rope (GQA)", f"[{s}, {b}, {ng}, {(qpg + 2) * d}]", 2 * (qpg + 1) * n * ESZ,
                        2 * (qpg + 2) * n * ESZ, impls, make_qkv, [0]))

    # linear_qkv's output split without RoPE (GPT-1.3B: 16 heads of 128, micro-batch 4 x seq 2048) and its bias's
    # gradient: backward reads the three gradients and writes one tensor. "eager" is the model's path before
    # split_qkv (torch.split's concatenation, then the linear's sum over the tokens). Forward: the bias's add.
    s, b, ng, d = (16, 2, 2, 16) if tiny else (2048, 4, 16, 128)
    n = s * b * ng * d

    def split_biased(m, bias, ng=ng, d=d):
        q, k, v = torch.split(m + bias.view(ng, -1), [d, d, d], dim=3)
        return q, k, v

    out.append(Case("qkv split + bias grad", f"[{s}, {b}, {ng}, {3 * d}]", 6 * n * ESZ, 6 * n * ESZ,
                    # the same forward each (the bias added here, by linear_qkv's GEMM in the model)
                    {"ours": lambda m, bias, ng=ng, d=d: fused.split_qkv(m + bias.detach().view(ng, -1), 1, d, bias),
                     "eager": split_biased,
                     "compile": compiled(split_biased)},
                    lambda s=s, b=b, ng=ng, d=d: [rn(s, b, ng, 3 * d), rn(ng * 3 * d)], [0, 1]))

    for bnp, s in ((((2, 64) if tiny else (32, 4096)),) if quick else ((64, 2048), (32, 4096), (8, 8192))):
        n = bnp * s * s
        sc = 0.088
        out.append(Case("causal_softmax", f"[{bnp}, {s}, {s}]", int(1.5 * n * ESZ), 2 * n * ESZ,
                        {"ours": lambda x: fused.scaled_upper_triang_masked_softmax(x, sc),
                         "eager": lambda x: eager_causal_softmax(x, sc),
                         "compile": compiled(lambda x: eager_causal_softmax(x, sc))},
                        lambda bnp=bnp, s=s: [rn(bnp, s, s)], [0]))

    # A bias's gradient, the output gradient summed over the tokens (GPT-1.3B's 8192 tokens: linear_proj's and
    # linear_fc2's bias [h], linear_qkv's [3h], linear_fc1's [4h]): one read. "eager" is the sum the linear took.
    for cols in ((64,) if tiny else (2048, 6144, 8192)):
        n = (64 if tiny else 8192) * cols
        out.append(Case("bias_grad", f"[{n // cols}, {cols}]", n * ESZ, None,
                        {"ours": fused.bias_grad, "eager": lambda x: x.sum(0), "compile": compiled(lambda x: x.sum(0))},
                        lambda cols=cols, n=n: [rn(n // cols, cols)], []))

    # The loss at TP = 1 on GPT-2's and LLaMA-3's vocabularies, 8192 tokens (micro-batch 4 x seq 2048):
    # the fewest bytes are one read forward, one read and one write backward. "eager" is what a user
    # writes (F.cross_entropy on fp32 logits); the fused op's own fallback is the eager one inside it.
    for v in ((256,) if tiny else (50304, 128256)):
        n = (64 if tiny else 8192) * v
        out.append(Case("cross_entropy", f"[{n // v}, {v}]", n * ESZ, 2 * n * ESZ,
                        {"ours": fused.cross_entropy, "eager": eager_cross_entropy,
                         "compile": compiled(eager_cross_entropy)},
                        lambda v=v, n=n: [rn(n // v, v), torch.randint(0, v, (n // v,), device=dev)], [0]))
    return out


def bench_wgrad(log, quick, tiny):
    rows = []
    sizes = ((16384, 4096, 4096),) if quick else ((16384, 4096, 4096), (16384, 11008, 4096), (8192, 8192, 8192))
    for n, out_f, in_f in ((64, 32, 48),) if tiny else sizes:
        inp = torch.randn(n, in_f, device=DEV, dtype=DT)
        go = torch.randn(n, out_f, device=DEV, dtype=DT)
        mg = torch.randn(out_f, in_f, device=DEV)
        flops = 2 * n * out_f * in_f
        t = {"fused (GEMM into fp32 main_grad)": bench_ms(lambda: fused.wgrad_accumulate(inp, go, mg)),
             "unfused: bf16 GEMM -> temp, add_": bench_ms(lambda: mg.add_(go.t() @ inp))}
        try:
            t["unfused: GEMM -> fp32 temp, add_"] = bench_ms(lambda: mg.add_(torch.mm(go.t(), inp, out_dtype=torch.float32)))
        except Exception as e:  # noqa: BLE001 - out_dtype is recent
            log(f"  wgrad fp32-temp variant unavailable: {type(e).__name__}: {str(e)[:120]}")
        base = t["fused (GEMM into fp32 main_grad)"]
        for name, ms in t.items():
            rows.append((f"[{n}, {out_f}]^T @ [{n}, {in_f}]", name, ms, flops / (ms * 1e-3) / 1e12, ms / base))
            log(f"  wgrad {rows[-1][0]} {name}: {ms:.3f} ms, {rows[-1][3]:.0f} TFLOP/s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--quick", action="store_true", help="one size per op")
    ap.add_argument("--tiny", action="store_true", help="toy sizes, to check the script itself (runs on CPU too)")
    ap.add_argument("--only", default="", help="comma-separated substrings: time only the ops whose name has one "
                    "(e.g. norm,softmax,wgrad)")
    args = ap.parse_args()
    global DEV
    if args.tiny and not torch.cuda.is_available():
        DEV = "cpu"
    elif not torch.cuda.is_available() or do_bench is None:
        sys.exit("kernels_bench: needs a CUDA device and triton")
    elif _ext.get_ext() is None:
        sys.exit(f"kernels_bench: CUDA extension unavailable ({_ext.load_error()})")

    def log(msg):
        print(msg, flush=True)

    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        card = f"{props.name} ({props.multi_processor_count} SMs)"
    else:
        card = "CPU (--tiny smoke run, times meaningless)"
    bw = copy_bandwidth()
    log(f"device: {card}; torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    if not HAVE_LIGER:
        log(f"liger-kernel not importable: {LIGER_ERROR}")
    only = [w for w in args.only.split(",") if w]

    def wanted(op: str) -> bool:
        return not only or any(w in op for w in only)

    rows = []
    for case in cases(args.quick, args.tiny):
        if not wanted(case.op):
            continue
        run_case(case, bw, rows, log)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    wg = bench_wgrad(log, args.quick, args.tiny) if wanted("wgrad") else []

    peers = ["eager", "compile", "liger"]
    lines = [
        f"Card: {card}, torch {torch.__version__}, "
        f"{datetime.date.today().isoformat()}; copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written).",
        "",
        "Times are medians in ms (bf16). BW = minimum bytes moved / our time; % = of the copy bandwidth. "
        "vs best = fastest peer's time / ours (> 1: ours is faster).",
        "",
        "| op | shape | pass | ours | eager | torch.compile | liger | ours GB/s | % copy BW | vs best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["op"], r["shape"], r["pass"], fmt(r["ours"])]
        cells += [fmt(r.get("p_" + p)) if ("p_" + p) in r else "-" for p in peers]
        cells += [fmt(r["gbs"], 0), "n/a" if r["frac"] is None else "%.0f%%" % (100 * r["frac"]),
                  "n/a" if r["speedup"] is None else "%.2fx" % r["speedup"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| wgrad GEMM (bf16 operands, fp32 main_grad) | variant | ms | TFLOP/s | time / fused |", "|---|---|---|---|---|"]
    for shape, name, ms, tf, rel in wg:
        lines.append(f"| {shape} | {name} | {ms:.3f} | {tf:.0f} | {rel:.2f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
