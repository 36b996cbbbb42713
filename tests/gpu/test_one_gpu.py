"""One-GPU behaviours the NCCL suite does not reach: seeding, the device rule, the model on CUDA."""
import math

import pytest
import torch

from parallel3d import tensor_parallel as tp
from parallel3d.device import default_backend, default_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setenv("PARALLEL3D_DEVICE", "cuda")  # the suite's conftest keeps the CPU tests on the CPU


def test_device_rule_picks_the_gpu(on_cuda):
    assert default_device() == torch.device("cuda", torch.cuda.current_device())
    assert default_backend() == "nccl"


def test_model_parallel_seed_leaves_the_cpu_generator_alone(on_cuda):
    """Megatron seeds only CUDA there: weights initialised on the CPU afterwards stay the script's."""
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    tp.model_parallel_cuda_manual_seed(7)
    assert torch.equal(torch.rand(4), want)
    cuda_a = torch.rand(4, device="cuda")
    tp.model_parallel_cuda_manual_seed(7)
    assert torch.equal(torch.rand(4, device="cuda"), cuda_a), "the CUDA generator is seeded"


def test_tracker_forks_the_cuda_generator(on_cuda):
    tp.model_parallel_cuda_manual_seed(7, tp_rank=0)
    default = torch.cuda.get_rng_state()
    with tp.get_cuda_rng_tracker().fork():
        a = torch.rand(4, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), default), "the default CUDA stream is left as it was"
    tp.model_parallel_cuda_manual_seed(7, tp_rank=1)
    with tp.get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(4, device="cuda"), a), "TP ranks draw different streams"


def test_dropout_in_captured_graphs_draws_what_eager_layers_draw(on_cuda):
    """Dropout on the default stream and on the tracker's TP stream, captured as training captures a layer
    (make_graphed_callables, the tracker's states registered, the generators kept across the capture): each
    replay draws new numbers, exactly the ones three eager calls draw from the same starting states."""
    import torch.nn.functional as F

    from parallel3d.training.cuda_graphs import _random_streams_registered_and_kept

    tracker = tp.get_cuda_rng_tracker()

    def layer(x):
        with tracker.fork():
            tp_region = F.dropout(x, 0.5)
        return tp_region + 2 * F.dropout(x, 0.5)

    tp.model_parallel_cuda_manual_seed(7, tp_rank=0)
    x = torch.ones(4096, device="cuda", requires_grad=True)
    default, tracked = torch.cuda.get_rng_state(), tracker.get_states()
    eager = [layer(x).detach().clone() for _ in range(3)]
    torch.cuda.set_rng_state(default)
    tracker.set_states(tracked)
    with _random_streams_registered_and_kept():
        graphed = torch.cuda.make_graphed_callables(layer, (x,))
    replays = [graphed(x).detach().clone() for _ in range(3)]
    assert not torch.equal(eager[0], eager[1]), "the eager calls draw new numbers"
    for step, (want, got) in enumerate(zip(eager, replays)):
        assert torch.equal(got, want), f"replay {step + 1} drew other numbers than eager call {step + 1}"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gpt_on_the_gpu_equals_the_cpu(on_cuda, family):
    """The same model and tokens, fp32: the GPU's loss and gradients equal the CPU's within 1e-5."""
    from parallel3d.models import GPTModel, gpt2_config, llama_config

    cfg = (gpt2_config if family == "gpt2" else llama_config)("tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                                              seq_length=32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    results = {}
    for device in ("cpu", "cuda"):
        model = GPTModel(cfg).to(device)
        assert all(p.device.type == "cuda" for p in GPTModel(cfg).parameters()), "built on the default device"
        loss = model(ids.to(device), None, labels=labels.to(device)).mean()
        loss.backward()
        results[device] = (loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    assert abs(results["cuda"][0] - results["cpu"][0]) <= 1e-5 * max(1.0, results["cpu"][0])
    assert abs(results["cpu"][0] - math.log(cfg.vocab_size)) < 0.5
    for name, g_cpu in results["cpu"][1].items():
        err = (results["cuda"][1][name] - g_cpu).abs().max().item()
        assert err <= 1e-5, f"{family} {name}: GPU gradient differs from the CPU's by {err:.3g}"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_layers_equal_eager_on_the_gpu(on_cuda, family):
    """--compile on CUDA: Inductor's Triton code (fused kernels give way to it) against eager with the
    fused kernels, fp32, the same tokens: loss and gradients within 1e-5."""
    import dataclasses

    from parallel3d.models import GPTModel, gpt2_config, llama_config

    cfg = (gpt2_config if family == "gpt2" else llama_config)("tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                                              seq_length=64)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=g).cuda()
    labels = torch.randint(0, cfg.vocab_size, (2, 64), generator=g).cuda()
    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPTModel(dataclasses.replace(cfg, compile_layers=compiled))
        loss = model(ids, None, labels=labels).mean()
        loss.backward()
        results[compiled] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    for name, want in results[False][1].items():
        err = (results[True][1][name] - want).abs().max().item()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), f"{family} {name}: compiled differs by {err:.3g}"


def test_embedding_gradient_into_main_grad_on_the_gpu(on_cuda):
    """gradient_accumulation_fusion's lookup on CUDA: a bf16 table's rows add into the fp32 main_grad as the
    fp64 sum of their gradients (repeated ids included), and the same bits on every run (index_put_ sorts)."""
    torch.manual_seed(0)
    emb = tp.VocabParallelEmbedding(1000, 64, make_vocab_size_divisible_by=1, params_dtype=torch.bfloat16,
                                    gradient_accumulation_fusion=True)
    ids = torch.randint(0, 50, (4, 512), device="cuda")  # 2048 lookups of 50 rows: every row repeats
    g = torch.randn(4, 512, 64, device="cuda", dtype=torch.bfloat16)
    want = torch.zeros(1000, 64, dtype=torch.float64, device="cuda").index_add_(0, ids.reshape(-1),
                                                                               g.reshape(-1, 64).double())
    runs = []
    for _ in range(2):
        emb.weight.main_grad, emb.weight.grad_added_to_main_grad = torch.zeros(1000, 64, device="cuda"), False
        emb(ids).backward(g)
        runs.append(emb.weight.main_grad)
    assert emb.weight.grad_added_to_main_grad
    torch.testing.assert_close(runs[0].double(), want, rtol=1e-5, atol=1e-5)  # fp32 sums of ~40 bf16 values
    assert torch.equal(runs[0], runs[1]), "the embedding's fused gradient differs between two runs"
