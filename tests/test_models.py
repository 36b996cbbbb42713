"""The GPT model: conventions against a plain reference, recomputation, pipeline split, TP/SP.

Single process: a dense nanoGPT-style reference written from HF's conventions (separate q/k/v,
rotate-half RoPE, repeat_kv, [gate, up]) reads the model's parameters and must give the same
loss; recomputation (full uniform/block, selective) reproduces loss and gradients with dropout
on; pipeline stages built with pre/post flags and layer ranges, chained by hand, reproduce the
full model's loss, parameters and gradients.
Multi-process: one launch of 4 ranks sweeps TP in {1, 2, 4} x SP for both families (GQA at
TP=2, MHA at TP=4) against the single-process model, in fp32.
"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import parallel3d.models.attention as attention_module
from parallel3d.models import GPTModel, gather_logits, gpt2_config, llama_config, llama_ffn_hidden_size
from parallel3d import parallel_state as ps
from parallel3d.model_chunk import CheckpointableConfig, PipelineChunk
from parallel3d import tensor_parallel as tp
from parallel3d.tensor_parallel import split_tensor_for_rank
from parallel3d.testing import run_distributed, single_process_layout

ATOL = 1e-5
B, S = 2, 16


def _close(a, b, what, atol=ATOL):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a.float() - b.float()).abs().max().item()
    assert err <= atol, f"{what}: max abs diff {err:.3g} > {atol}"


def _config(family, **overrides):
    base = dict(hidden_dropout=0.0, attention_dropout=0.0, seq_length=S)
    base.update(overrides)
    return (gpt2_config if family == "gpt2" else llama_config)("tiny", **base)


def _data(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    position_ids = torch.arange(S).expand(B, S)
    weights = torch.rand(B, S, generator=g)  # a non-uniform reduction, so every token's grad matters
    return ids, position_ids, labels, weights


def _loss_and_grads(model, cfg, seed=0, dropout_seed=None):
    ids, pos, labels, w = _data(cfg, seed)
    if dropout_seed is not None:
        tp.model_parallel_cuda_manual_seed(dropout_seed)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, labels=labels)
    (loss * w).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ reference (HF conventions)

def _reference_loss(model, cfg, ids, labels):
    """A dense GPT in the style of HF GPT-2 / LLaMA, reading GPTModel's parameters."""
    P = {n: p.detach() for n, p in model.named_parameters()}
    nh, ng, d, H = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.hidden_size
    b, s = ids.shape

    def norm(x, prefix):
        if cfg.normalization == "RMSNorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * P[prefix + ".weight"]
        return F.layer_norm(x, (H,), P[prefix + ".weight"], P[prefix + ".bias"], cfg.layernorm_epsilon)

    def rope(x):  # x [b, n, s, d]; HF LLaMA's rotate_half on the first rot channels (partial rotary)
        rot = int(d * cfg.rotary_percent)
        inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, rot, 2).float() / rot))
        freqs = torch.outer(torch.arange(s).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x, x_pass = x[..., :rot], x[..., rot:]
        x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
        return torch.cat((x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin(), x_pass), dim=-1)

    x = P["embedding.word_embeddings.weight"][ids]
    if cfg.position_embedding_type == "learned_absolute":
        x = x + P["embedding.position_embeddings.weight"][:s]
    for i in range(cfg.num_layers):
        pre = f"decoder.layers.{i}."
        h = norm(x, pre + "input_layernorm")
        # Megatron's fused QKV: per query group [q heads of the group, k, v] -> HF's q_proj/k_proj/v_proj
        w = P[pre + "self_attention.linear_qkv.weight"].view(ng, (nh // ng + 2) * d, H)
        wq, wk, wv = w.split([nh // ng * d, d, d], dim=1)
        bq = bk = bv = None
        if pre + "self_attention.linear_qkv.bias" in P:
            bias = P[pre + "self_attention.linear_qkv.bias"].view(ng, (nh // ng + 2) * d)
            bq, bk, bv = (t.reshape(-1) for t in bias.split([nh // ng * d, d, d], dim=1))
        q = F.linear(h, wq.reshape(nh * d, H), bq).view(b, s, nh, d).transpose(1, 2)
        k = F.linear(h, wk.reshape(ng * d, H), bk).view(b, s, ng, d).transpose(1, 2)
        v = F.linear(h, wv.reshape(ng * d, H), bv).view(b, s, ng, d).transpose(1, 2)
        if cfg.position_embedding_type == "rope":
            q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // ng, dim=1), v.repeat_interleave(nh // ng, dim=1)  # HF repeat_kv
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, nh * d)
        x = x + F.linear(att, P[pre + "self_attention.linear_proj.weight"], P.get(pre + "self_attention.linear_proj.bias"))
        h = norm(x, pre + "pre_mlp_layernorm")
        u = F.linear(h, P[pre + "mlp.linear_fc1.weight"], P.get(pre + "mlp.linear_fc1.bias"))
        act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),  # HF GPT-2's gelu_new
               "silu": F.silu}[cfg.activation]
        if cfg.gated_linear_unit:
            gate, up = u.chunk(2, dim=-1)  # HF LLaMA: act(gate_proj(x)) * up_proj(x)
            u = act(gate) * up
        else:
            u = act(u)
        x = x + F.linear(u, P[pre + "mlp.linear_fc2.weight"], P.get(pre + "mlp.linear_fc2.bias"))
    x = norm(x, "decoder.final_layernorm")
    out_w = P["output_layer.weight" if cfg.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"]
    logits = x @ out_w[: cfg.vocab_size].t()
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none").view(b, s)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_backward_and_reference(family):
    cfg = _config(family, num_layers=2)
    model = GPTModel(cfg)
    ids, pos, labels, w = _data(cfg)
    loss = model(ids, pos, labels=labels)
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    assert abs(loss.mean().item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform prediction at init
    _close(loss, _reference_loss(model, cfg, ids, labels), "loss vs HF-convention reference")

    logits = model(ids, pos)
    assert logits.shape == (B, S, cfg.padded_vocab_size)
    full = gather_logits(logits, cfg.vocab_size)
    assert full.shape == (B, S, cfg.vocab_size)
    ref = F.cross_entropy(full.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none").view(B, S)
    _close(loss, ref, "loss vs cross entropy of the gathered logits")
    masked = model(ids, pos, labels=labels, loss_mask=(labels % 2).float())
    _close(masked, loss * (labels % 2), "loss_mask")

    (loss * w).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
    emb = model.embedding.word_embeddings.weight
    assert torch.all(emb[cfg.vocab_size:] == 0) and torch.all(emb.grad[cfg.vocab_size:] == 0), "padding rows"
    assert (model.shared_embedding_or_output_weight() is emb) == (family == "gpt2")
    assert [layer.layer_number for layer in model.decoder.layers] == [1, 2]
    assert isinstance(model, PipelineChunk) and isinstance(cfg, CheckpointableConfig)  # the model contract
    saved = dataclasses.asdict(cfg)
    assert cfg.checkpoint_mismatches(saved) == []
    assert cfg.checkpoint_mismatches({**saved, "hidden_size": 8, "seed": 9}) == [
        f"hidden_size: checkpoint 8 vs this run {cfg.hidden_size}"]  # architecture only, not the seed


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", dict(activation="gelu")),
    ("gpt2", dict(activation="gelu", gated_linear_unit=True, ffn_hidden_size=96)),  # GeGLU
    ("llama", dict(gated_linear_unit=False, ffn_hidden_size=96, add_qkv_bias=True)),
    ("gpt2", dict(rotary_percent=0.5, position_embedding_type="rope", bias_activation_fusion=False)),
])
def test_other_variants_match_reference(family, overrides):
    cfg = _config(family, **overrides)
    model = GPTModel(cfg)
    with torch.no_grad():  # non-zero biases so that their layout is checked too
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    ids, pos, labels, _ = _data(cfg)
    _close(model(ids, pos, labels=labels), _reference_loss(model, cfg, ids, labels), f"{family} {overrides}")


def test_attention_backends_masks_and_fusion_flags_agree(monkeypatch):
    for family in ("gpt2", "llama"):
        cfg = _config(family)
        ids, pos, labels, _ = _data(cfg)
        ref = GPTModel(cfg)(ids, pos, labels=labels)
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
        plain = dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                     apply_rope_fusion=False, normalization_fusion=False)
        for variant, mask in ((dict(attention_backend="local"), None), (dict(attention_backend="local"), causal),
                              (dict(), causal), (plain, None), (dict(attention_backend="local", **plain), None)):
            out = GPTModel(_config(family, **variant))(ids, pos, attention_mask=mask, labels=labels)
            _close(out, ref, f"{family} {variant} mask={mask is not None}")
        with monkeypatch.context() as m:  # torch < 2.5: key/value heads repeated
            m.setattr(attention_module, "_SDPA_HAS_GQA", False)
            _close(GPTModel(cfg)(ids, pos, labels=labels), ref, f"{family} torch<2.5 fallbacks")
        # A mask that hides more than the causal one changes the result the same way on both backends.
        mask = causal.clone().expand(B, 1, S, S).clone()
        mask[0, :, :, :3] = True
        mask[0, 0, torch.arange(3), torch.arange(3)] = False  # every query keeps at least itself
        a = GPTModel(cfg)(ids, pos, attention_mask=mask, labels=labels)
        b = GPTModel(_config(family, attention_backend="local"))(ids, pos, attention_mask=mask, labels=labels)
        _close(a, b, f"{family} padding mask, sdpa vs local")
        assert not torch.allclose(a, ref)


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}),  # grouped query attention: two q heads a group
    ("gpt2", dict(position_embedding_type="rope", rotary_percent=0.5)),  # partial rotary, a q head a group
])
def test_the_fused_rope_path_matches_the_unfused_one(monkeypatch, family, overrides):
    """attention.py's fused RoPE path (fused.split_qkv_rope's autograd function, the GPU kernel emulated by its
    contract) against apply_rope_fusion=False: the loss and every gradient. tests/gpu runs the kernel itself."""
    from types import SimpleNamespace

    from fused_reference import emulated_rope_apply

    from parallel3d.fused import _ext, rope

    ids, pos, labels, w = _data(_config(family, **overrides))
    unfused = GPTModel(_config(family, apply_rope_fusion=False, **overrides))
    fused = GPTModel(_config(family, **overrides))
    fused.load_state_dict(unfused.state_dict())
    launches = []
    monkeypatch.setattr(rope, "_kernel_ok", lambda *a: True)
    monkeypatch.setattr(_ext, "get_ext", lambda: SimpleNamespace(
        rope_apply=lambda *a: (launches.append(a[4:]), emulated_rope_apply(*a))))
    losses = []
    for model in (unfused, fused):
        losses.append(model(ids, pos, labels=labels))
        (losses[-1] * w).sum().backward()
    _close(losses[1], losses[0], f"{family} loss")
    for (name, a), b in zip(fused.named_parameters(), unfused.parameters()):
        _close(a.grad, b.grad, f"{family} {name}.grad")
    layers = fused.config.num_layers
    assert launches == [(False,)] * layers + [(True, True)] * layers  # one launch a layer each way


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel_contract"])
def test_linear_qkv_bias_gradient_comes_from_the_split(monkeypatch, kernel):
    """GPT-2 (biases, no RoPE): linear_qkv adds its bias but leaves the bias's gradient to fused.split_qkv, whose
    backward sums it while merging dq, dk and dv (with `kernel`, its GPU path, the kernel emulated by its
    contract; tests/gpu runs the kernel itself). In every layer it must be the column sum of linear_qkv's output
    gradient, and the linear must not add a second one."""
    from types import SimpleNamespace

    from parallel3d.fused import rope

    cfg = _config("gpt2")
    ids, pos, labels, w = _data(cfg)
    model = GPTModel(cfg)
    outputs = []

    def keep(module, args, out):
        out[0].retain_grad()
        outputs.append(out[0])

    for layer in model.decoder.layers:
        layer.self_attention.linear_qkv.register_forward_hook(keep)
    launches = []
    if kernel:
        def merge(dq, dk, dv, with_sum):
            launches.append(with_sum)
            out = torch.cat([dq.flatten(3), dk, dv], dim=3)
            return [out, out.flatten(2).sum((0, 1))]

        # rope.py's view of the extension only: the model's other ops keep their CPU paths
        monkeypatch.setattr(rope, "_ext", SimpleNamespace(use_kernel=lambda *tensors: True,
                                                          get_ext=lambda: SimpleNamespace(qkv_grad_merge=merge)))
    (model(ids, pos, labels=labels) * w).sum().backward()
    assert len(outputs) == cfg.num_layers and launches == ([True] * cfg.num_layers if kernel else [])
    for i, (layer, out) in enumerate(zip(model.decoder.layers, outputs)):
        _close(layer.self_attention.linear_qkv.bias.grad, out.grad.sum((0, 1)), f"layer {i} linear_qkv.bias.grad")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_recompute_reproduces_loss_and_grads_with_dropout(family):
    cfg_kw = dict(num_layers=3, hidden_dropout=0.2, attention_dropout=0.2)
    base = GPTModel(_config(family, **cfg_kw))
    loss, grads = _loss_and_grads(base, base.config, dropout_seed=7)
    ids, pos, labels, _ = _data(base.config)
    with torch.no_grad():
        assert not torch.allclose(loss, base.eval()(ids, pos, labels=labels)), "dropout had no effect"
    for recompute in (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
                      dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
                      dict(recompute_granularity="selective")):
        model = GPTModel(_config(family, **cfg_kw, **recompute))
        got_loss, got_grads = _loss_and_grads(model, model.config, dropout_seed=7)
        _close(got_loss, loss, f"{recompute} loss", atol=1e-6)
        for name, g in grads.items():
            _close(got_grads[name], g, f"{recompute} grad {name}", atol=1e-6)


# ------------------------------------------------------------------ pipeline split in one process

@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pipeline_stages_chained_by_hand_match_full_model(family):
    full_cfg = _config(family, num_layers=4)
    full = GPTModel(full_cfg)
    ref_loss, ref_grads = _loss_and_grads(full, full_cfg)
    full_params = dict(full.named_parameters())
    ids, pos, labels, w = _data(full_cfg)

    layouts = {
        "PP=2": dict(pipeline_model_parallel_size=2),
        "PP=2 x VP=2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        "PP=2 uneven": dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1),
    }
    for what, pp_kw in layouts.items():
        cfg = _config(family, num_layers=4, **pp_kw)
        counts = cfg.layers_per_virtual_stage()  # virtual stage v = chunk * PP + rank, in model order
        ranges = [range(sum(counts[:v]), sum(counts[:v + 1])) for v in range(len(counts))]
        last = len(ranges) - 1
        stages = [GPTModel(cfg, pre_process=k == 0, post_process=k == last, layer_numbers=r)
                  for k, r in enumerate(ranges)]
        for stage in stages:  # layout independence: the stages hold exactly the full model's values
            for name, p in stage.named_parameters():
                assert torch.equal(p, full_params[stage.global_parameter_name(name)]), f"{what}: {name} differs"

        # Forward stage by stage (stage k's output is stage k+1's input), then backward in reverse.
        inputs, outputs = [None], []
        for k, stage in enumerate(stages):
            stage.set_input_tensor(inputs[-1])
            # Later stages get no position_ids (Megatron's middle stages read no data): RoPE must not need them.
            out = stage(ids if k == 0 else None, pos if k == 0 else None, labels=labels if k == last else None)
            outputs.append(out)
            if k < last:
                assert out.shape == (S, B, full_cfg.hidden_size)
                inputs.append(out.detach().requires_grad_())
        _close(outputs[-1], ref_loss, f"{what} loss")
        (outputs[-1] * w).sum().backward()
        for k in range(last - 1, -1, -1):
            outputs[k].backward(inputs[k + 1].grad)

        grads = {}
        for stage in stages:
            for name, p in stage.named_parameters():
                full_name = stage.global_parameter_name(name)
                grads[full_name] = grads.get(full_name, 0) + p.grad  # the tied weight: first + last stage
        assert grads.keys() == ref_grads.keys(), f"{what}: parameters differ"
        for name, g in ref_grads.items():
            _close(grads[name], g, f"{what} grad {name}")

        tied = family == "gpt2"
        shared = [s.shared_embedding_or_output_weight() for s in stages]
        assert (shared[0] is stages[0].embedding.word_embeddings.weight) == tied
        assert (shared[-1] is stages[-1].output_layer.weight) == tied
        assert all(x is None for x in shared[1:-1])
        assert all(getattr(x, "shared_embedding", False) for x in shared if x is not None)


# ------------------------------------------------------------------ configs and errors

def test_presets_and_derived_fields():
    assert llama_ffn_hidden_size(4096) == 11008  # LLaMA-7B's 2/3 * 4h rounded up to 256
    c = llama_config("7b")
    assert (c.ffn_hidden_size, c.num_query_groups, c.kv_channels, c.padded_vocab_size) == (11008, 32, 128, 32000)
    c = llama_config("1b", tensor_model_parallel_size=8)
    assert (c.num_query_groups, c.rotary_base, c.padded_vocab_size) == (8, 500000.0, 129024)
    c = gpt2_config("124m")
    assert (c.ffn_hidden_size, c.activation, c.padded_vocab_size, c.untie_embeddings_and_output_weights) == \
        (3072, "gelu_tanh", 50304, False)
    assert llama_config("tiny", num_layers=8, pipeline_model_parallel_size=2,
                        virtual_pipeline_model_parallel_size=2).layers_per_virtual_stage() == [2, 2, 2, 2]
    assert llama_config("tiny", num_layers=10, pipeline_model_parallel_size=3, virtual_pipeline_model_parallel_size=2,
                        num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=4
                        ).layers_per_virtual_stage() == [1, 2, 2, 1, 2, 2]
    # Any layer total is a config (a layout or the balanced split places the layers, as Megatron's layout
    # does); the even split it is asked for must exist.
    uneven = llama_config("tiny", num_layers=3, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"num_layers \(3\) is not divisible by pipeline_model_parallel_size \(2\) x "
                                         r"virtual_pipeline_model_parallel_size \(1\) = 2: no even split"):
        uneven.layers_per_virtual_stage()
    with pytest.raises(ValueError, match=r"num_layers \(4\) is not divisible by .* = 8"):
        llama_config("tiny", num_layers=4, pipeline_model_parallel_size=2,
                     virtual_pipeline_model_parallel_size=4).layers_per_virtual_stage()
    assert gpt2_config("tiny", bf16=True).params_dtype == torch.bfloat16
    assert gpt2_config("tiny", params_dtype="fp16").params_dtype == torch.float16
    with pytest.warns(UserWarning, match="sequence_parallel=True has no effect"):
        assert gpt2_config("tiny", sequence_parallel=True).sequence_parallel is False


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_attention_heads=6), r"hidden_size \(64\) is not divisible by num_attention_heads \(6\)"),
    (dict(tensor_model_parallel_size=8), r"num_attention_heads \(4\) is not divisible by tensor_model_parallel_size \(8\)"),
    (dict(num_query_groups=3), r"num_attention_heads \(4\) is not divisible by num_query_groups \(3\)"),
    (dict(tensor_model_parallel_size=4), r"num_query_groups \(2\) is not divisible by tensor_model_parallel_size \(4\)"),
    (dict(num_layers=5, pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2),
     r"the 3 layers left for the 2 middle pipeline stage\(s\) are not divisible by 2"),
    (dict(num_layers=5, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2,
          num_layers_in_last_pipeline_stage=2), r"num_layers \(5\) does not match"),
    (dict(num_layers=4, virtual_pipeline_model_parallel_size=2), r"needs pipeline_model_parallel_size > 1"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, seq_length=33),
     r"seq_length \(33\) divisible by tensor_model_parallel_size \(2\)"),
    (dict(bf16=True, fp16=True), "bf16 and fp16 are both set"),
    (dict(bf16=True, params_dtype="fp16"), "contradicts bf16=True"),
    (dict(recompute_granularity="everything"), "recompute_granularity must be one of"),
    (dict(hidden_dropout=1.0), r"hidden_dropout must be in \[0, 1\)"),
    (dict(rotary_percent=0.1), r"rotary dimension .* = 1 must be an even number"),
    (dict(nonsense=1), r"unknown TransformerConfig field\(s\) \['nonsense'\]"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        llama_config("tiny", **kwargs)


def test_bad_model_inputs():
    with pytest.raises(ValueError, match=r"seq_length \(40\) exceeds max_position_embeddings \(32\)"):
        gpt2_config("tiny", seq_length=40, max_position_embeddings=32)
    with pytest.raises(ValueError, match="unknown gpt2 size 'huge'"):
        gpt2_config("huge")
    with pytest.raises(ValueError, match=r"config.tensor_model_parallel_size=2 but the tensor-parallel group has 1"):
        GPTModel(_config("gpt2", tensor_model_parallel_size=2))
    cfg = _config("gpt2", num_layers=2)
    with pytest.raises(ValueError, match=r"layer_numbers must be a step-1 range inside range\(0, 2\)"):
        GPTModel(cfg, layer_numbers=range(1, 3))
    stage = GPTModel(cfg, pre_process=False, layer_numbers=range(1, 2))
    with pytest.raises(RuntimeError, match="call set_input_tensor"):
        stage(None, None)
    model = GPTModel(cfg)
    ids, pos, labels, _ = _data(cfg)
    with pytest.raises(ValueError, match=r"labels must be \[batch, seq\] = \(2, 16\), got \(2, 15\)"):
        model(ids, pos, labels=labels[:, 1:])
    with pytest.raises(ValueError, match="attention_mask must be a bool tensor"):
        model(ids, pos, attention_mask=torch.zeros(1, 1, S, S))
    with pytest.raises(ValueError, match=r"sequence length 33 exceeds max_position_embeddings \(16\)"):
        model(torch.zeros(1, 33, dtype=torch.long), None)


def test_bf16_parameters_fp32_loss():
    cfg = _config("llama", bf16=True)
    model = GPTModel(cfg)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids, pos, labels, _ = _data(cfg)
    loss = model(ids, pos, labels=labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.mean().backward()
    ref = GPTModel(_config("llama"))(ids, pos, labels=labels)
    _close(loss, ref, "bf16 vs fp32 loss", atol=0.05)  # same initial values, bf16 rounding only


# ------------------------------------------------------------------ tensor + sequence parallel

def _shard_of(full, param, rank, world):
    """The part of the full (TP=1) tensor that this rank's shard ``param`` holds (padding rows zero)."""
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return full
    return split_tensor_for_rank(full, param.partition_dim, param.partition_stride, rank, world,
                                 padded_size=param.size(param.partition_dim) * world)


_SWEEP = [  # (family, overrides, [(tp, sp), ...])
    ("gpt2", dict(), [(1, False), (2, False), (2, True), (4, False), (4, True)]),
    ("llama", dict(num_query_groups=2), [(1, False), (2, False), (2, True)]),  # GQA
    ("llama", dict(num_query_groups=None), [(4, False), (4, True)]),  # MHA: 4 heads over 4 ranks
]


def _sweep_cfg(family, overrides, **kw):
    # vocab 300 pads to 384 at TP=1 but 512 at TP=2/4: padding must not change the loss.
    return _config(family, num_layers=2, vocab_size=300, **overrides, **kw)


def _tp_sweep(rank, world_size):
    torch.manual_seed(0)
    references = []
    with single_process_layout():  # TP = PP = 1: plain single-process models
        for family, overrides, _ in _SWEEP:
            model = GPTModel(_sweep_cfg(family, overrides))
            loss, grads = _loss_and_grads(model, model.config)
            references.append((loss, grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    done = []
    for (family, overrides, layouts), (ref_loss, ref_grads, ref_params) in zip(_SWEEP, references):
        for tp_size, sp in layouts:
            what = f"[{family} {overrides} TP={tp_size} SP={sp}]"
            ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
            try:
                r = ps.get_tensor_model_parallel_rank()
                cfg = _sweep_cfg(family, overrides, tensor_model_parallel_size=tp_size, sequence_parallel=sp)
                model = GPTModel(cfg)
                for name, p in model.named_parameters():
                    _close(p, _shard_of(ref_params[name], p, r, tp_size), f"{what} init {name}", atol=0.0)
                loss, grads = _loss_and_grads(model, cfg)
                tp.allreduce_sequence_parallel_gradients(model.parameters())
                _close(loss, ref_loss, f"{what} loss")
                for name, p in model.named_parameters():
                    _close(p.grad, _shard_of(ref_grads[name], p, r, tp_size), f"{what} grad {name}")
                    assert getattr(p, "sequence_parallel", False) == (sp and p.dim() == 1
                                                                      and not getattr(p, "tensor_model_parallel", False)), \
                        f"{what} {name}: sequence_parallel attribute"
                if sp and family == "gpt2":
                    _check_recompute_under_sp(cfg, what)
            finally:
                ps.destroy_model_parallel()
            done.append((family, tp_size, sp))
    return done


def _check_recompute_under_sp(cfg, what):
    """Dropout on sequence shards (tracked stream) is replayed exactly by full and selective recompute."""
    results = []
    for recompute in (None, "full", "selective"):
        model = GPTModel(dataclasses.replace(cfg, hidden_dropout=0.2, attention_dropout=0.2,
                                             recompute_granularity=recompute))
        loss, grads = _loss_and_grads(model, model.config, dropout_seed=11)
        results.append((loss, grads))
    for (loss, grads), recompute in zip(results[1:], ("full", "selective")):
        _close(loss, results[0][0], f"{what} recompute={recompute} loss", atol=1e-6)
        for name, g in grads.items():
            _close(g, results[0][1][name], f"{what} recompute={recompute} grad {name}", atol=1e-6)


def test_tensor_and_sequence_parallel_match_single_process():
    results = run_distributed(_tp_sweep, 4, timeout=240)
    expected = [(family, t, sp) for family, _, layouts in _SWEEP for t, sp in layouts]
    assert all(r == expected for r in results)
