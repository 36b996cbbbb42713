"""Megatron-LM's FP8 flags (its "Transformer-Engine" group), with Megatron's names, defaults and
destinations (``args.fp8``, ``args.fp8_recipe``, ...: TransformerConfig's fields of the same names).

FP8 runs in the transformer layers' linears (tensor_parallel/fp8.py, torch._scaled_mm); the
output layer and the embeddings stay in bf16. What Megatron has under FP8 and parallel3d does not
do is refused by name (``REFUSED_FP8``), before any work.
"""
from __future__ import annotations

import argparse

import torch

from parallel3d.tensor_parallel.fp8 import AMAX_COMPUTE_ALGOS, FORMATS, RECIPES, REFUSED_RECIPES

# Megatron's FP8/FP4 flags with no implementation here -> what to do instead.
REFUSED_FP8: dict[str, str] = {
    "--fp8-param-gather": "parameters stay in bf16 and are all-gathered in bf16; omit the flag",
    "--fp8-dot-product-attention": "attention runs in bf16 (torch SDPA); FP8 covers the linears; omit the flag",
    "--fp8-multi-head-attention": "attention runs in bf16 (torch SDPA); FP8 covers the linears; omit the flag",
    "--first-last-layers-bf16": "every transformer layer runs its linears in FP8 (the output layer and embeddings "
                                "in bf16); omit the flag",
    "--num-layers-at-start-in-bf16": "see --first-last-layers-bf16: omit the flag",
    "--num-layers-at-end-in-bf16": "see --first-last-layers-bf16: omit the flag",
    "--fp4-format": "FP4 is not implemented; use --fp8-format hybrid",
    "--fp4-recipe": "FP4 is not implemented; use --fp8-format hybrid",
    "--fp4-param-gather": "FP4 is not implemented; omit the flag",
}
# Fields that only the delayed recipe reads (Megatron ignores them under other recipes: we warn).
DELAYED_ONLY = ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")


def add_fp8_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("FP8 (Megatron-LM's Transformer-Engine flags; torch._scaled_mm here, on GPUs of "
                             "compute capability 8.9 or higher, emulated on CPU processes)")
    g.add_argument("--fp8-format", dest="fp8", choices=list(FORMATS), default=None,
                   help="FP8 GEMMs in the transformer layers' linears (needs --bf16): e4m3 everywhere, or hybrid "
                        "(e4m3 forward, e5m2 gradients); the output layer and embeddings stay in bf16")
    g.add_argument("--fp8-recipe", choices=list(RECIPES) + list(REFUSED_RECIPES), default="delayed",
                   help="delayed (Megatron's default: scales from an amax history, updated once per step), "
                        "tensorwise (current scaling), rowwise (a parallel3d recipe, not Megatron's: "
                        "torchao/torchtitan's per-row scales); mxfp8, blockwise and custom are refused")
    g.add_argument("--fp8-margin", type=int, default=0, help="delayed: scale = fp8 max / amax / 2**margin")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed: steps of amax history per tensor")
    g.add_argument("--fp8-amax-compute-algo", choices=list(AMAX_COMPUTE_ALGOS), default="most_recent",
                   help="delayed: the scale from the newest amax or the largest of the history")
    g.add_argument("--no-fp8-wgrad", dest="fp8_wgrad", action="store_false",
                   help="the weight-gradient GEMM in bf16 (forward and input gradient stay in FP8)")
    g.add_argument("--fp8-interval", type=int, default=1,
                   help="deprecated in Megatron, which ignores it; accepted and ignored likewise")
    for flag, why in REFUSED_FP8.items():
        g.add_argument(flag, nargs="*", default=None, help=f"refused: {why}")


def fp8_problems(args: argparse.Namespace) -> list[str]:
    """One line per FP8 flag this run cannot honour (each names the flag and the fix)."""
    problems = [f"{flag} is not supported by parallel3d: {why}" for flag, why in REFUSED_FP8.items()
                if getattr(args, flag[2:].replace("-", "_"), None) is not None]
    if args.fp8_recipe in REFUSED_RECIPES:
        problems.append(f"--fp8-recipe {args.fp8_recipe} is not supported by parallel3d: "
                        f"{REFUSED_RECIPES[args.fp8_recipe]}")
    if args.fp8 is None:
        return problems
    if not args.bf16:
        problems.append(f"--fp8-format {args.fp8} needs --bf16 (FP8 GEMMs with bf16 parameters and activations, "
                        "fp32 master weights); add --bf16")
    if args.fp8_amax_history_len < 1:
        problems.append(f"--fp8-amax-history-len must be >= 1, got {args.fp8_amax_history_len}")
    if args.fp8_margin < 0:
        problems.append(f"--fp8-margin must be >= 0, got {args.fp8_margin}")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        problems.append(f"--fp8-format {args.fp8}: {torch.cuda.get_device_name()} has no FP8 tensor cores (compute "
                        "capability 8.9 or higher: H100, H200, L40, RTX 40xx); run in bf16 (omit the flag)")
    return problems


def fp8_ineffective(args: argparse.Namespace, defaults: dict) -> list[str]:
    """FP8 flags that the combination leaves without effect (Megatron ignores them without a word)."""
    names = ["--" + name.replace("_", "-") for name in DELAYED_ONLY if getattr(args, name) != defaults.get(name)]
    if args.fp8 is None:
        names += ["--fp8-recipe"] * (args.fp8_recipe != defaults.get("fp8_recipe"))
        names += ["--no-fp8-wgrad"] * (not args.fp8_wgrad)
        return [f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect without --fp8-format"] \
            if names else []
    if args.fp8_recipe != "delayed" and names:
        return [f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect: they tune --fp8-recipe "
                f"delayed, not {args.fp8_recipe}"]
    return []
