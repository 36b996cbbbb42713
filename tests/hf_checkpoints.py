"""Shared by tests/test_checkpoint_conversion.py and tests/test_checkpoint_generation.py: tiny HF models, converted.

Tiny random models are made locally with transformers (GPT2Config / LlamaConfig; nothing is
downloaded): a tied GPT-2 (vocab 257, padded for TP) and an untied GQA LLaMA (vocab 300).
Each is converted HF -> TP2xPP2 -> (reshard) TP1xPP4xV2 -> (reshard) TP4xPP1 -> HF (the
``hf`` and ``checkpoints`` fixtures of tests/conftest.py build them once per session).
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # tools/ is not installed with the package
    sys.path.insert(0, ROOT)

from parallel3d.tools.convert_checkpoint import convert  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 250]
NEW_TOKENS = 10
# (name, TP, PP, virtual PP): the chain every family is converted through, in this order
LAYOUTS = [("tp2pp2", 2, 2, None), ("tp1pp4v2", 1, 4, 2), ("tp4pp1", 4, 1, None)]


def _hf_class(family: str):
    # transformers is imported where used, not at the top: the gloo workers import this module
    # and would each pay for it (seconds on 2 cores)
    import transformers

    return transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM


def _hf_model(family: str, num_layers: int = 8, hidden: int = None, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":  # tied; gelu_new; a large init so greedy tokens vary and win by clear margins
        return GPT2LMHeadModel(GPT2Config(**{**dict(
            n_layer=num_layers, n_embd=hidden or 32, n_head=4, n_positions=48, vocab_size=257, initializer_range=0.5,
            layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None), **overrides})).eval()
    return LlamaForCausalLM(LlamaConfig(**{**dict(
        num_hidden_layers=num_layers, hidden_size=hidden or 64, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=96, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False,
        rope_theta=5000.0, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=None, eos_token_id=None),
        **overrides})).eval()


def _hf_logprobs(model, tokens):
    """log p(tokens[i+1] | tokens[:i+1]) under a transformers model, fp32."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]
    return lp[torch.arange(len(tokens) - 1), ids[0, 1:]].tolist()


def hf_references(tmp_path_factory):
    """family -> (HF dir, model, greedy tokens, their logprobs)."""
    out = {}
    for family in ("gpt2", "llama"):
        model = _hf_model(family)
        path = str(tmp_path_factory.mktemp(f"hf_{family}"))
        model.save_pretrained(path)
        with torch.no_grad():
            gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        # the reference must not hinge on near-ties
        assert min(float(s.topk(2).values[0, 0] - s.topk(2).values[0, 1]) for s in gen.scores) > 1e-2
        tokens = gen.sequences[0].tolist()
        out[family] = (path, model, tokens, _hf_logprobs(model, tokens))
    return out


def converted_checkpoints(hf, tmp_path_factory):
    """family -> {layout name: parallel3d dir, "hf": the round-tripped HF dir}."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for family, (hf_dir, *_rest) in hf.items():
        dirs, source, loader = {}, hf_dir, "hf"
        for name, tp, pp, vp in LAYOUTS:
            dirs[name] = str(root / f"{family}_{name}")
            convert(loader, "parallel3d", source, dirs[name], target_tensor_parallel_size=tp,
                    target_pipeline_parallel_size=pp, target_virtual_pipeline_parallel_size=vp)
            source, loader = dirs[name], "parallel3d"
        dirs["hf"] = str(root / f"{family}_hf")
        convert("parallel3d", "hf", source, dirs["hf"])
        out[family] = dirs
    return out
