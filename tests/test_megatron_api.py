"""Megatron-Core's API where parallel3d's differed: the tensor-parallel layers take ``config=`` (and
Megatron's other constructor keywords) as Megatron's do, while parallel3d's own keywords still work
and win over the config; the DDP config has Megatron-Core's defaults."""
from types import SimpleNamespace

import pytest
import torch

from parallel3d import tensor_parallel as tp

INIT = tp.init_method_normal(0.3)


def _megatron_config(**fields):
    base = dict(params_dtype=torch.float64, sequence_parallel=False, gradient_accumulation_fusion=False,
                use_cpu_initialization=True, perform_initialization=True, expert_model_parallel_size=1)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("cls,extra", [(tp.ColumnParallelLinear, dict(gather_output=False)),
                                       (tp.RowParallelLinear, dict(input_is_parallel=True))])
def test_linear_layers_take_megatrons_config(cls, extra):
    torch.manual_seed(0)
    a = cls(8, 6, config=_megatron_config(), init_method=INIT, bias=True, skip_bias_add=False, **extra)
    torch.manual_seed(0)
    b = cls(8, 6, params_dtype=torch.float64, init_method=INIT, **extra)
    assert a.weight.dtype == torch.float64 and a.weight.device.type == "cpu"
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(a(x)[0], b(x)[0], rtol=0, atol=0)
    assert a.config.params_dtype == torch.float64
    # a keyword given wins over the config's field
    assert cls(8, 6, config=_megatron_config(), params_dtype=torch.float32, **extra).weight.dtype == torch.float32
    # perform_initialization=False draws nothing from the generator
    state = torch.get_rng_state()
    cls(8, 6, config=_megatron_config(perform_initialization=False), init_method=INIT, **extra)
    assert torch.equal(torch.get_rng_state(), state)


def test_megatrons_full_column_signature_and_refusals():
    tp.ColumnParallelLinear(8, 6, config=_megatron_config(), init_method=INIT, bias=True, gather_output=False, stride=1,
                            keep_master_weight_for_test=False, skip_bias_add=False, skip_weight_param_allocation=False,
                            embedding_activation_buffer=None, grad_output_buffer=None, is_expert=False,
                            tp_comm_buffer_name="fc1", disable_grad_reduce=False, tp_group=None)
    tp.RowParallelLinear(8, 6, config=_megatron_config(), init_method=INIT, bias=True, input_is_parallel=True,
                         skip_bias_add=True, stride=1, keep_master_weight_for_test=False, is_expert=False,
                         tp_comm_buffer_name="fc2", tp_group=None)
    for kwargs, match in ((dict(is_expert=True), "is_expert=True is not supported"),
                          (dict(keep_master_weight_for_test=True), "keep_master_weight_for_test=True is not supported"),
                          (dict(config=_megatron_config(expert_model_parallel_size=2)),
                           "expert_model_parallel_size=2")):
        with pytest.raises(ValueError, match=match):
            tp.ColumnParallelLinear(8, 6, init_method=INIT, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_keyword'"):
        tp.RowParallelLinear(8, 6, no_such_keyword=1)
    with pytest.raises(ValueError, match="sequence_parallel=True requires input_is_parallel=True"):
        tp.RowParallelLinear(8, 6, config=_megatron_config(sequence_parallel=True), input_is_parallel=False)


def test_embedding_takes_megatrons_config_and_its_padded_vocabulary():
    torch.manual_seed(0)
    a = tp.VocabParallelEmbedding(40, 8, init_method=INIT, config=_megatron_config())
    torch.manual_seed(0)
    b = tp.VocabParallelEmbedding(40, 8, init_method=INIT, params_dtype=torch.float64)
    # Megatron's embedding takes the vocabulary as padded by the caller; parallel3d's own default pads to 128
    assert a.weight.shape == (40, 8) and b.weight.shape == (128, 8) and a.weight.dtype == torch.float64
    torch.testing.assert_close(a.weight, b.weight[:40], rtol=0, atol=0)
    with pytest.raises(ValueError, match="deterministic_mode=True is not supported"):
        tp.VocabParallelEmbedding(40, 8, config=_megatron_config(deterministic_mode=True))


def test_ddp_config_defaults_are_megatrons():
    import dataclasses

    from parallel3d.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ours = {f.name: f.default for f in dataclasses.fields(DistributedDataParallelConfig)}
    assert ours["overlap_grad_reduce"] is False and ours["bucket_size"] is None
    try:
        from megatron.core.distributed import DistributedDataParallelConfig as MegatronConfig
    except ImportError:  # megatron-core not installed: the values above are its 0.16 defaults
        MegatronConfig = None
    if MegatronConfig is not None:
        theirs = {f.name: f.default for f in dataclasses.fields(MegatronConfig)}
        assert {k: v for k, v in ours.items() if k in theirs} == {k: theirs[k] for k in ours if k in theirs}
    # bucket_size=None means Megatron's max(40M, 1M x DP) with overlap: one bucket for a small model
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True))
    assert len(ddp.buckets) == 1
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100))
    assert len(ddp.buckets) == 2
