"""``--help`` text: one line per option (Megatron-LM's meaning) and its default.

Kept apart from arguments.py so the option definitions stay short; ``add_help(parser)`` fills in
the lines of options defined without one, and HelpFormatter appends each option's default.
"""
from __future__ import annotations

import argparse

HELP: dict[str, str] = {
    "num_layers": "transformer layers", "hidden_size": "hidden width h",
    "num_attention_heads": "attention heads", "kv_channels": "per-head width (default h / heads)",
    "group_query_attention": "grouped-query attention (with --num-query-groups)",
    "num_query_groups": "key/value head groups for --group-query-attention",
    "seq_length": "tokens per training sample", "max_position_embeddings": "position table size (default "
    "--seq-length)", "position_embedding_type": "learned_absolute (GPT-2) or rope (LLaMA)",
    "rotary_base": "RoPE base period", "rotary_percent": "fraction of each head that is rotated",
    "normalization": "LayerNorm (GPT-2) or RMSNorm (LLaMA)", "norm_epsilon": "epsilon of the norms",
    "swiglu": "SwiGLU MLP (LLaMA) instead of GeLU", "disable_bias_linear": "no biases in the linear layers",
    "add_qkv_bias": "a QKV bias even with --disable-bias-linear (Qwen)",
    "untie_embeddings_and_output_weights": "separate output layer instead of the tied embedding",
    "attention_dropout": "dropout on attention probabilities", "hidden_dropout": "dropout on residual branches",
    "init_method_std": "standard deviation of the weight initialisation",
    "make_vocab_size_divisible_by": "pad the vocabulary to a multiple of this x TP",
    "attention_backend": "auto/flash/fused: torch SDPA (picks its fastest kernel); unfused/local: explicit "
    "softmax", "recompute_granularity": "activation recomputation: full layers or selective (attention core)",
    "recompute_method": "full recompute: uniform (every N layers) or block (the first N per stage)",
    "recompute_num_layers": "layers per recompute group (full recompute)",
    "bias_gelu_fusion": "turn off the fused bias+GeLU kernel (GeLU models)",
    "bias_swiglu_fusion": "turn off fused bias+SwiGLU (--swiglu models)",
    "bias_dropout_fusion": "turn off fused bias+dropout+add", "masked_softmax_fusion": "turn off fused softmax",
    "apply_rope_fusion": "turn off the fused RoPE kernel",
    "tensor_model_parallel_size": "TP: ranks splitting each layer", "pipeline_model_parallel_size": "PP: stages",
    "num_layers_per_virtual_pipeline_stage": "interleaved pipeline: layers per virtual stage",
    "virtual_pipeline_model_parallel_size": "interleaved pipeline: model chunks per stage",
    "microbatch_group_size_per_vp_stage": "interleaved schedule: microbatches per chunk in a row (default PP)",
    "decoder_first_pipeline_num_layers": "layers on the first pipeline stage (uneven split)",
    "decoder_last_pipeline_num_layers": "layers on the last pipeline stage (uneven split)",
    "sequence_parallel": "split norms and dropout along the sequence over TP ranks",
    "use_distributed_optimizer": "ZeRO-1: shard optimizer state over data-parallel ranks",
    "accumulate_allreduce_grads_in_fp32": "reduce gradients in fp32 (always with --bf16/--fp16)",
    "micro_batch_size": "samples per microbatch per data-parallel rank", "exit_interval": "stop after an "
    "iteration that is a multiple of this", "lr": "peak learning rate", "min_lr": "learning rate floor",
    "lr_decay_style": "learning-rate decay after warmup", "lr_decay_iters": "decay length (default --train-iters)",
    "lr_warmup_iters": "linear warmup length", "lr_warmup_fraction": "warmup as a fraction of the decay length",
    "lr_wsd_decay_iters": "WSD: annealing length", "lr_wsd_decay_style": "WSD: annealing shape",
    "weight_decay": "decoupled weight decay (not on biases and norms)", "optimizer": "adam (AdamW) or sgd",
    "adam_beta1": "Adam beta1", "adam_beta2": "Adam beta2", "adam_eps": "Adam epsilon", "sgd_momentum": "SGD "
    "momentum", "clip_grad": "clip the global gradient norm (0: off)", "bf16": "bf16 mixed precision",
    "fp16": "fp16 mixed precision with loss scaling", "initial_loss_scale": "fp16 dynamic scale: start",
    "min_loss_scale": "fp16 dynamic scale: floor", "loss_scale_window": "fp16: good steps before the scale "
    "grows", "hysteresis": "fp16: overflows tolerated before the scale shrinks",
    "calculate_per_token_loss": "average the loss over all tokens of the step, not per microbatch",
    "seed": "random seed (weights, dropout, data order)", "split": "train,valid,test weights of --data-path",
    "tokenizer_model": "HuggingFaceTokenizer's tokenizer.json (or its directory)",
    "num_workers": "data-loader worker processes (Megatron's default is 2; ours, 0, reads in the training "
    "process)", "dataloader_type": "single (one pass) or cyclic",
    "eod_mask_loss": "no loss on end-of-document tokens", "log_interval": "iterations per log line",
    "tensorboard_dir": "write TensorBoard scalars here", "eval_interval": "iterations between evaluations",
    "eval_iters": "iterations per evaluation", "save": "checkpoint directory to save to",
    "load": "checkpoint directory to resume from (missing or empty: start from scratch)",
    "save_interval": "iterations between saves (default: at the end)",
    "no_load_optim": "resume without optimizer and LR scheduler state",
    "no_load_rng": "resume without RNG state", "no_progress_bar": "plain log lines even on a terminal",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Megatron's option list with each default, skipping the noise of "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action, argparse._StoreTrueAction):
            return action.help or ""
        return super()._get_help_string(action)


def add_help(parser: argparse.ArgumentParser) -> None:
    """Give every option without a help line its line from HELP; use HelpFormatter."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if not action.help and action.dest in HELP:
            action.help = HELP[action.dest]
