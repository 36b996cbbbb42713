"""Megatron-LM checkpoints written and read by Megatron-Core itself (megatron-core from pip, on CPU with gloo).

Megatron-Core's GPTModel (LLaMA-shaped: GQA, SwiGLU, RMSNorm, RoPE, untied; and GPT-shaped:
LayerNorm, biases, learned positions, tied) is built at TP=2 x PP=2 on 4 gloo processes and
saved with Megatron's own code in both formats: legacy (each rank's
``state_dict_for_save_checkpoint()`` under Megatron-LM's ``iter_NNNNNNN/mp_rank_XX_YYY/
model_optim_rng.pt`` names) and ``torch_dist`` (``dist_checkpointing.save``). Converted to
parallel3d at TP=1 x PP=1, parallel3d's logits equal Megatron-Core's; converted back to
Megatron's legacy format at TP=2 x PP=2 and to torch_dist, a freshly initialised Megatron-Core model
loads each (a strict ``load_state_dict``; ``dist_checkpointing.load(strict="raise_all")``) and gives
the same logits again.

Megatron-Core on a CPU needs: use_cpu_initialization, an explicit causal mask, and shims for
``torch.cuda.current_device`` / ``synchronize`` / ``Tensor.cuda`` and the CUDA RNG tracker's fork
(dropout is 0);
its torch_dist writer forks helper processes, which the harness's daemonic workers may not, and
reports memory through psutil: both are stubbed in the worker.
"""
import argparse
import contextlib
import os
import random
import signal
import sys
import warnings

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401
    MCORE_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means: skip, saying why
    MCORE_ERROR = f"megatron-core cannot be imported ({type(e).__name__}: {e}); pip install megatron-core"

pytestmark = pytest.mark.skipif(MCORE_ERROR is not None, reason=MCORE_ERROR or "")

TP, PP, SEQ, ITERATION = 2, 2, 12, 5
FAMILIES = {
    # family -> (megatron-core TransformerConfig / GPTModel settings, Megatron-LM args)
    "llama": dict(normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, num_query_groups=2,
                  position="rope", tied=False),
    "gpt": dict(normalization="LayerNorm", gated_linear_unit=False, add_bias_linear=True, num_query_groups=None,
                position="learned_absolute", tied=True),
}
TRUE_VOCAB, PADDED_VOCAB = 100, 128  # make_vocab_size_divisible_by=32 x TP=2 pads 100 to 128


def _shims():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied embedding's copy is all-reduced "on the GPU"
    import megatron.core.tensor_parallel.random as mrandom

    # dropout is 0: the forked CUDA RNG stream is never drawn from
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()


def _megatron_args(family):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    f = FAMILIES[family]
    return argparse.Namespace(
        num_layers=4, hidden_size=32, num_attention_heads=4, kv_channels=8, ffn_hidden_size=48,
        group_query_attention=f["num_query_groups"] is not None, num_query_groups=f["num_query_groups"] or 1,
        seq_length=16, max_position_embeddings=16, position_embedding_type=f["position"], rotary_base=10000,
        rotary_percent=1.0, normalization=f["normalization"], norm_epsilon=1e-5, swiglu=f["gated_linear_unit"],
        openai_gelu=False, add_bias_linear=f["add_bias_linear"], add_qkv_bias=False,
        bias_gelu_fusion=f["add_bias_linear"],  # Megatron's default, off without biases (its validate_args)
        untie_embeddings_and_output_weights=not f["tied"], make_vocab_size_divisible_by=32,
        padded_vocab_size=PADDED_VOCAB, tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
        virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32, fp16=False, bf16=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3, seed=1234, transformer_impl="local",
        tokenizer_type="NullTokenizer", model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
        exit_signal=signal.SIGTERM, ckpt_format="torch", iteration=ITERATION)


def _build(family, seed):
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    f = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=f["num_query_groups"],
        ffn_hidden_size=48, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP, normalization=f["normalization"],
        gated_linear_unit=f["gated_linear_unit"],
        activation_func=torch.nn.functional.silu if f["gated_linear_unit"] else torch.nn.functional.gelu,
        add_bias_linear=f["add_bias_linear"], hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3,
        layernorm_epsilon=1e-5,
        # as Megatron-LM's args build the GPT: its fused bias-GeLU, the tanh approximation (bias_gelu_impl)
        bias_activation_fusion=not f["gated_linear_unit"] and f["add_bias_linear"])
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization=f["normalization"]),
                     vocab_size=PADDED_VOCAB, max_sequence_length=16, position_embedding_type=f["position"],
                     share_embeddings_and_output_weights=f["tied"], pre_process=mps.is_pipeline_first_stage(),
                     post_process=mps.is_pipeline_last_stage(), parallel_output=False).eval()
    with torch.no_grad():  # make the biases matter (Megatron zero-initialises them)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


def _logits(model, tokens):
    """Megatron-Core's forward over the pipeline, stage to stage by hand; the full logits on the last stage."""
    from megatron.core import parallel_state as mps

    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    position_ids = torch.arange(s).expand(b, s)
    with torch.no_grad():
        if not mps.is_pipeline_first_stage():
            hidden = torch.empty(s, b, 32)
            torch.distributed.recv(hidden, src=mps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, position_ids, mask)
        if not mps.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(), dst=mps.get_pipeline_model_parallel_next_rank())
            return None
        return out


def _save_legacy(model, args, root):
    from megatron.core import parallel_state as mps

    tp, pp = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
    rank_dir = os.path.join(root, f"iter_{ITERATION:07d}", f"mp_rank_{tp:02d}_{pp:03d}")
    os.makedirs(rank_dir, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model.state_dict_for_save_checkpoint(),
             "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
             "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": ITERATION}}
    torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def _save_dist(model, args, root):
    import multiprocessing
    import queue

    from megatron.core import dist_checkpointing
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async

    multiprocessing.current_process()._config["daemon"] = False  # its writer forks; harness workers are daemons
    fs_async._results_queue = queue.Queue()
    fs_async._process_memory = lambda: 0  # psutil
    path = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": ITERATION,
                             "checkpoint_version": 3.0}, path)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def _load_dist(model, path):
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # as Megatron-LM does at start-up: common.pt holds its argparse.Namespace
    return dist_checkpointing.load({"model": model.sharded_state_dict()}, path, strict="raise_all")


def _worker(rank, world_size, root, families):
    warnings.filterwarnings("ignore")
    _shims()
    from megatron.core import parallel_state as mps

    from parallel3d.tools.checkpoint.megatron_files import safe_load
    from parallel3d.tools.convert_checkpoint import convert

    mps.initialize_model_parallel(TP, PP)
    tokens = torch.randint(0, TRUE_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    out = {}
    try:
        for family in families:
            base = os.path.join(root, family)
            model = _build(family, seed=1)
            args = _megatron_args(family)
            logits = _logits(model, tokens)
            _save_legacy(model, args, os.path.join(base, "legacy"))
            _save_dist(model, args, os.path.join(base, "dist"))
            torch.distributed.barrier()
            if rank == 0:  # Megatron -> parallel3d (TP=1 x PP=1) -> Megatron legacy at TP=2 x PP=2
                for fmt in ("legacy", "dist"):
                    convert("megatron", "parallel3d", os.path.join(base, fmt), os.path.join(base, f"p3d_{fmt}"),
                            true_vocab_size=TRUE_VOCAB)
                convert("parallel3d", "megatron", os.path.join(base, "p3d_legacy"), os.path.join(base, "back"),
                        target_tensor_parallel_size=TP, target_pipeline_parallel_size=PP)
                convert("parallel3d", "megatron", os.path.join(base, "p3d_dist"), os.path.join(base, "back_dist"),
                        target_tensor_parallel_size=TP, ckpt_format="torch_dist")
            torch.distributed.barrier()
            fresh = _build(family, seed=99)
            tp, pp = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
            saved = safe_load(os.path.join(base, "back", f"iter_{ITERATION:07d}", f"mp_rank_{tp:02d}_{pp:03d}",
                                           "model_optim_rng.pt"))
            fresh.load_state_dict(saved["model"], strict=True)
            back = _logits(fresh, tokens)
            fresh = _build(family, seed=98)
            loaded = _load_dist(fresh, os.path.join(base, "back_dist", f"iter_{ITERATION:07d}"))
            fresh.load_state_dict(loaded["model"], strict=True)
            out[family] = (tokens, logits, back, _logits(fresh, tokens), saved["args"].padded_vocab_size)
    finally:
        mps.destroy_model_parallel()
    return out


def _parallel3d_logits(path, tokens):
    from safetensors.torch import load_file

    from parallel3d.models import GPTModel
    from parallel3d.tools.checkpoint.parallel3d_format import config_from_metadata
    from parallel3d.training.checkpointing import (find_checkpoint_dir, rank_dir_name, read_latest_iteration,
                                                   read_metadata)

    ckpt = find_checkpoint_dir(path, read_latest_iteration(path))
    meta = read_metadata(ckpt)
    config = config_from_metadata(meta["model_config"], ckpt)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (1, 1)
    model = GPTModel(config).eval()
    state = load_file(os.path.join(ckpt, rank_dir_name(0, 0), "model.safetensors"))
    model.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()})
    with torch.no_grad():
        return model(tokens, None)[..., :config.vocab_size], meta


def test_megatron_core_checkpoints_in_both_formats_convert_both_ways(tmp_path):
    from parallel3d.testing import run_distributed

    families = list(FAMILIES)
    results = run_distributed(_worker, world_size=TP * PP, args=(str(tmp_path), families), timeout=300)
    last = [r for r in results if r[families[0]][1] is not None]
    assert len(last) == TP  # the last pipeline stage's TP ranks hold the (gathered) logits
    for family in families:
        tokens, logits, back, back_dist, padded = last[0][family]
        assert logits.shape == (2, SEQ, PADDED_VOCAB) and padded == PADDED_VOCAB
        for fmt in ("legacy", "dist"):
            ours, meta = _parallel3d_logits(str(tmp_path / family / f"p3d_{fmt}"), tokens)
            assert meta["iteration"] == ITERATION
            torch.testing.assert_close(ours, logits[..., :TRUE_VOCAB], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{family} {fmt}: {m}")
        # the export, loaded by Megatron-Core: the real vocabulary's logits are Megatron-Core's own
        torch.testing.assert_close(back[..., :TRUE_VOCAB], logits[..., :TRUE_VOCAB], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(back_dist[..., :TRUE_VOCAB], logits[..., :TRUE_VOCAB], rtol=1e-5, atol=1e-5)
        assert (tmp_path / family / "back" / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
