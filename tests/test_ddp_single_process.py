"""DistributedDataParallel in one process: its config's refusals, the bucket layout, the NaN check, and that a
dropped DDP is freed at once (tests/test_ddp.py trains it against single-process training on gloo ranks)."""
import pytest
import torch

from blocks import DenseBlock
from parallel3d.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    OptimizerConfig,
    finalize_model_grads,
    get_megatron_optimizer,
)
from test_ddp import B_MICRO, Config, Net, dense_init, global_data


def test_config_validation():
    with pytest.raises(ValueError, match="bucket_size must be a positive int"):
        DistributedDataParallelConfig(bucket_size=0)
    with pytest.raises(ValueError, match="lr must be set"):
        OptimizerConfig()
    with pytest.raises(ValueError, match="bf16 and fp16"):
        OptimizerConfig(lr=1.0, bf16=True, fp16=True)
    with pytest.raises(ValueError, match="params_dtype"):
        OptimizerConfig(lr=1.0, bf16=True)
    with pytest.raises(ValueError, match="average_in_collective=True cannot be combined"):
        DistributedDataParallel(Net(DenseBlock, 1, Config(True)),
                                DistributedDataParallelConfig(average_in_collective=True))
    ddp = DistributedDataParallel(Net(DenseBlock, 1), DistributedDataParallelConfig())
    with pytest.raises(ValueError, match="use_distributed_optimizer=True but model chunk 0"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), [ddp])
    with pytest.raises(TypeError, match="wrap it in DistributedDataParallel"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0), [Net(DenseBlock, 1)])
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        finalize_model_grads([ddp], num_tokens=torch.tensor(3.0))


def test_buckets_reverse_order_and_padding():
    model = Net(DenseBlock, 2)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=600))
    params = [p for p in model.parameters()]
    order = [p for b in ddp.buckets for p in b.params]
    assert order == params[::-1], "buckets hold the parameters in reverse order"
    for b in ddp.buckets:
        assert b.numel_unpadded <= 600 or len(b.params) == 1
        for p in b.params:
            s, e = b.param_ranges[p]
            assert p.main_grad.data_ptr() == b.grad_data[s:e].data_ptr()
    # ZeRO-1 layout: bucket sizes divisible by DP x alignment (DP=1 here: the alignment alone)
    model = Net(DenseBlock, 1)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(bucket_size=100, use_distributed_optimizer=True))
    assert all(b.numel % 64 == 0 for b in ddp.buckets)
    for p in model.parameters():  # parameters now live in the contiguous parameter buffer
        buf = ddp.param_and_grad_buffers[0].param_data
        assert buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size()


def test_check_for_nan_in_grad_names_the_parameter():
    model = Net(DenseBlock, 1)
    ddp = DistributedDataParallel(model, DistributedDataParallelConfig(check_for_nan_in_grad=True,
                                                                      overlap_grad_reduce=False))
    x, t, _ = global_data(0, B_MICRO)
    ((ddp(x) - t) ** 2).mean().backward()
    model.blocks[0].fc1.bias.main_grad[3] = float("nan")
    with pytest.raises(RuntimeError, match=r"NaN or Inf .*blocks\.0\.fc1\.bias"):
        ddp.finish_grad_sync()
    # a second backward in the same iteration after the reduction is refused, not silently mixed in
    ddp2 = DistributedDataParallel(Net(DenseBlock, 1), DistributedDataParallelConfig())
    ((ddp2(x) - t) ** 2).mean().backward()
    ddp2.finish_grad_sync()
    with pytest.raises(RuntimeError, match="zero_grad_buffer"):
        ((ddp2(x) - t) ** 2).mean().backward()
    ddp2.zero_grad_buffer()
    ((ddp2(x) - t) ** 2).mean().backward()
    ddp2.finish_grad_sync()


def test_a_dropped_ddp_is_freed_at_once_not_at_interpreter_shutdown():
    """No reference cycle through the parameters' hooks (which the garbage collector cannot see, as they pass
    through C++ tensors): once the caller drops the model, the DDP object and the process groups it holds go
    at once, not at interpreter shutdown, where gloo's worker threads aborted the process now and then."""
    import gc
    import weakref

    gc.disable()  # freed by reference counting alone, as at the end of a script
    try:
        model = dense_init(1, 0)
        ddp = DistributedDataParallel(model, DistributedDataParallelConfig())
        x, t, _ = global_data(0, B_MICRO)
        ((ddp(x) - t) ** 2).mean().backward()  # the hooks have run: the DDP and the parameters know each other
        ddp.finish_grad_sync()
        gone = weakref.ref(ddp)
        del ddp, model
        assert gone() is None
    finally:
        gc.enable()
