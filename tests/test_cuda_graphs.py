"""--enable-cuda-graph (Megatron's): refused by name where a captured layer cannot hold the run, before any work;
the block replays its graphs only for the captured training forward. The capture itself runs on GPUs
(tests/gpu/test_nccl_parity.py, the *-graph layouts, against one GPU)."""
import dataclasses
import itertools
import re

import pytest
import torch

from parallel3d.models import GPTModel, gpt2_config
from parallel3d.training.cuda_graphs import InFlight, LayerGraphs
from parallel3d.training.arguments import ArgumentError, parse_args, validate_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0"]


def _config(**overrides):
    settings = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "seq_length": 32, "enable_cuda_graph": True}
    return gpt2_config("tiny", **{**settings, **overrides})


@pytest.mark.parametrize("overrides, named", [
    ({"recompute_granularity": "full"}, "recompute_granularity"),
    ({"compile_layers": True}, "compile_layers"),
    ({"cuda_graph_warmup_steps": 0}, "cuda_graph_warmup_steps must be a positive integer"),
])
def test_what_a_graph_cannot_hold_is_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        _config(**overrides)


def test_a_config_a_graph_can_hold_is_accepted():
    cfg = _config()
    assert cfg.enable_cuda_graph and cfg.cuda_graph_warmup_steps == 3
    # FP8's cached weight operands are refreshed in place before each replay (tensor_parallel/fp8.py)
    assert _config(fp8="hybrid", bf16=True).cuda_graph_blocked_by() == []


@pytest.mark.parametrize("overrides", [{"hidden_dropout": 0.1}, {"attention_dropout": 0.1}])
def test_dropout_is_held_where_generators_have_graph_safe_states_and_refused_by_name_where_not(overrides, monkeypatch):
    """Dropout inside a graph draws from generator states each graph registers (training/cuda_graphs.py); a
    torch without them (no Generator.graphsafe_set_state) would replay one mask forever: refused there."""
    from parallel3d.models import config as model_config

    monkeypatch.setattr(model_config, "GRAPH_SAFE_RNG", True)
    assert _config(**overrides).enable_cuda_graph
    monkeypatch.setattr(model_config, "GRAPH_SAFE_RNG", False)
    with pytest.raises(ValueError, match=re.escape("hidden_dropout / attention_dropout > 0 (set both to 0")):
        _config(**overrides)


@pytest.mark.parametrize("flags, graphs", [
    ([], False),  # bf16 on one GPU: the graphs gained nothing
    (["--tensor-model-parallel-size", "2"], True),
    (["--fp8-format", "hybrid"], True),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--cuda-graph-impl", "none"], False),
    (["--fp8-format", "hybrid", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], False),
])
def test_graphs_are_the_default_of_tensor_parallel_and_fp8_runs_on_gpus(monkeypatch, flags, graphs):
    """Where the eager step waits on the host's launches (TP, FP8: BENCHMARKS.md) and nothing blocks a graph."""
    from parallel3d.training import arguments

    monkeypatch.setattr(arguments, "default_backend", lambda: "nccl")
    args = validate_args(parse_args(BASE + ["--bf16"] + flags), 2 if "--tensor-model-parallel-size" in flags else 1)
    assert args.enable_cuda_graph is graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_the_flag_is_refused_without_a_gpu_before_any_work():
    for flags in (["--enable-cuda-graph"], ["--cuda-graph-impl", "local"], ["--external-cuda-graph"]):
        with pytest.raises(ArgumentError, match=re.escape("--enable-cuda-graph (or --cuda-graph-impl) needs a CUDA")):
            validate_args(parse_args(BASE + flags), 1)


@pytest.mark.parametrize("flags, wanted", [
    ([], False),
    (["--enable-cuda-graph"], True),
    (["--cuda-graph-impl", "local"], True),
    (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules"], True),
    (["--external-cuda-graph", "--cuda-graph-scope", "full"], True),
    (["--cuda-graph-impl", "none", "--inference-cuda-graph-scope", "none"], False),
])
def test_megatrons_cuda_graph_flags_mean_per_layer_graphs(monkeypatch, flags, wanted):
    """Megatron-Core's --cuda-graph-impl local / transformer_engine and the deprecated --external-cuda-graph
    capture each layer's forward and backward, as --enable-cuda-graph does here; 'full' modules = a whole layer."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the flags' meaning, not the machine's
    assert validate_args(parse_args(BASE + flags), 1).enable_cuda_graph is wanted


TP2 = ["--tensor-model-parallel-size", "2"]


@pytest.mark.parametrize("flags, world, wanted", [
    (TP2, 2, True),
    (TP2 + ["--sequence-parallel", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], 4, True),
    (TP2 + ["--cuda-graph-impl", "none"], 2, False),  # Megatron's value for eager layers
    ([], 1, False),  # one GPU: no faster with graphs
    (TP2 + ["--hidden-dropout", "0.1"], 2, True),  # Megatron's default dropout: the graphs register its streams
    (TP2 + ["--recompute-granularity", "selective"], 2, False),
    (TP2 + ["--compile"], 2, False),
    (TP2 + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--global-batch-size", "4"], 4,
     False),
    (TP2 + ["--distributed-backend", "gloo"], 2, False),  # CPU ranks
])
def test_graphs_are_the_default_where_tensor_parallel_runs_on_gpus_and_a_graph_holds_the_run(
        monkeypatch, flags, world, wanted):
    """Where no flag decides, a TP run on GPUs replays its layers as graphs (faster on every TP layout measured),
    unless the run holds what a graph cannot (the same rule that refuses --enable-cuda-graph there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PARALLEL3D_DEVICE", "auto")  # the tests' CPU rule off: a machine with GPUs
    args = validate_args(parse_args(BASE + ["--num-layers", "4"] + flags), world)
    assert args.enable_cuda_graph is wanted


@pytest.mark.parametrize("flags, named", [
    (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl full_iteration is not supported"),
    (["--enable-cuda-graph", "--external-cuda-graph"], "cannot be given together"),
    (["--enable-cuda-graph", "--cuda-graph-impl", "local"], "--cuda-graph-impl local with --enable-cuda-graph"),
    (["--enable-cuda-graph", "--cuda-graph-impl", "none"], "--cuda-graph-impl none with --enable-cuda-graph"),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "mlp"], "--cuda-graph-modules attn mlp is not"),
    (["--cuda-graph-modules", "full", "--cuda-graph-scope", "full"], "give one"),
    (["--inference-cuda-graph-scope", "layer"], "--inference-cuda-graph-scope layer is not supported"),
    (["--cuda-graph-retain-backward-graph"], "--cuda-graph-retain-backward-graph is not supported"),
    (["--cuda-graph-use-single-mempool"], "--cuda-graph-use-single-mempool is not supported"),
])
def test_what_megatrons_cuda_graph_flags_ask_beyond_layers_is_refused_by_name(monkeypatch, flags, named):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ArgumentError, match=re.escape(named)):
        validate_args(parse_args(BASE + flags), 1)


def test_warmup_steps_must_be_positive():
    with pytest.raises(ArgumentError, match="--cuda-graph-warmup-steps must be >= 1, got 0"):
        validate_args(parse_args(BASE + ["--cuda-graph-warmup-steps", "0"]), 1)


class _Recording(InFlight):
    """Stands in for the captured graphs (one slot, never busy): which forwards it would replay; runs the layers
    eagerly."""

    def __init__(self, block, shape):
        super().__init__()
        self.block, self.shape, self.replayed = block, shape, []

    def _take(self, hidden_states, attention_mask, rotary_pos_emb, inference_params):
        return 0 if attention_mask is None and tuple(hidden_states.shape) == self.shape else None

    def layer(self, slot, index, hidden_states):
        self.replayed.append(index)
        return self.block.layers[index](hidden_states, None, None)


def test_the_block_replays_the_captured_forward_only_and_keeps_its_state_dict():
    torch.manual_seed(0)
    model = GPTModel(dataclasses.replace(_config(), enable_cuda_graph=False))
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    want = model(ids, None)
    keys = set(model.state_dict())
    graphs = _Recording(model.decoder, (32, 2, model.config.hidden_size))
    model.decoder.cuda_graphs = graphs
    assert set(model.state_dict()) == keys  # not a submodule: checkpoints are the same with graphs
    got = model(ids, None)
    assert graphs.replayed == [0, 1] and torch.equal(got, want)
    with torch.no_grad():  # evaluation runs the layers eagerly
        model(ids, None)
    model(ids[:1], None)  # another micro-batch size: eagerly too
    model.eval()
    model(ids, None)  # and evaluation with gradients on
    assert graphs.replayed == [0, 1]


def test_each_slot_captures_its_own_static_inputs_and_wrappers(monkeypatch):
    """make_graphed_callables keeps the sample tensors as a graph's static inputs (a replay copies its input
    there, the backward reads it) and points each module's forward at its graph. Two slots sharing either
    would replay one micro-batch's backward with another's input (the PP graph layouts' gradients were off on
    4 x H100), or capture a replay of the first slot inside the second."""
    calls = []

    def capture(callables, samples, allow_unused_input):
        calls.append((callables, samples))
        return tuple(callables)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    model = GPTModel(_config())
    shape = (32, 2, model.config.hidden_size)
    LayerGraphs(model.decoder.layers, shape, torch.float32, torch.device("cpu"), None, slots=3)
    assert len(calls) == 3
    wrappers = [id(module) for callables, _ in calls for module in callables]
    inputs = [sample.data_ptr() for _, samples in calls for (sample,) in samples]
    assert len(set(wrappers)) == len(wrappers) == 3 * len(model.decoder.layers)
    assert len(set(inputs)) == len(inputs)
    assert all(sample.shape == shape and sample.requires_grad for _, samples in calls for (sample,) in samples)


def _fake_capture(blocks, fail_after=None, error=None):
    """Stands in for capture_cuda_graphs (CUDA only): puts a _Recording on every block, which raises ``error``
    (default: a RuntimeError "a failed step") at replay number ``fail_after`` if given."""
    def capture(model, micro_batch_size):
        from parallel3d.training.cuda_graphs import _blocks

        for _, block in _blocks(model):
            shape = (block.config.seq_length, micro_batch_size, block.config.hidden_size)
            recording = _Recording(block, shape)
            if fail_after is not None:
                layer = recording.layer

                def failing(slot, index, hidden_states, layer=layer, recording=recording):
                    if len(recording.replayed) == fail_after:
                        raise error or RuntimeError("a failed step")
                    return layer(slot, index, hidden_states)

                recording.layer = failing
            block.cuda_graphs = recording
            blocks.append((block, recording))
        return len(blocks)

    return capture


def test_training_replays_after_the_warmup_steps_and_releases_the_graphs_at_the_end(monkeypatch):
    """pretrain captures after --cuda-graph-warmup-steps, every later training forward goes through the graphs,
    the losses are the eager run's, and the graphs are released when the loop ends (NCCL cannot destroy a
    communicator that a live graph captured)."""
    from gpt_harness import GBS, ITERS, MBS, layout_args, train
    from parallel3d.training import training

    blocks = []
    monkeypatch.setattr(training, "capture_cuda_graphs", _fake_capture(blocks))
    args = layout_args("gpt2")
    args.enable_cuda_graph, args.cuda_graph_warmup_steps = True, 1
    graphed = train(args)
    eager = train(layout_args("gpt2"))
    assert graphed["losses"] == eager["losses"] and graphed["grad_norms"] == eager["grad_norms"]
    ((block, recording),) = blocks
    assert graphed["model"][0].module.decoder is block and block.cuda_graphs is None  # released
    microbatches_after_capture = (ITERS - 1) * (GBS // MBS)
    assert recording.replayed == list(range(len(block.layers))) * microbatches_after_capture


def test_a_failed_step_still_releases_the_graphs(monkeypatch):
    from gpt_harness import layout_args, train
    from parallel3d.training import training

    blocks = []
    monkeypatch.setattr(training, "capture_cuda_graphs", _fake_capture(blocks, fail_after=3))
    args = layout_args("gpt2")
    args.enable_cuda_graph, args.cuda_graph_warmup_steps = True, 1
    with pytest.raises(RuntimeError, match="a failed step"):
        train(args)
    ((block, recording),) = blocks
    assert block.cuda_graphs is None and len(recording.replayed) == 3


OOM = "CUDA out of memory. Tried to allocate 2.00 GiB."


@pytest.mark.parametrize("where", ["capture", "replay", "no graphs"])
def test_out_of_memory_with_graphs_names_the_flag_that_turns_them_off(monkeypatch, where):
    """Graphs are on by default in TP and FP8 runs, and their pools hold memory the eager run does not: an out
    of memory error once they are captured says so and names --cuda-graph-impl none; without graphs (or
    before their capture) it is torch's own."""
    from gpt_harness import layout_args, train
    from parallel3d.training import training
    from parallel3d.training.training_guards import TrainingError

    def no_capture(model, micro_batch_size):
        raise torch.cuda.OutOfMemoryError(OOM)

    steps = []

    def out_of_memory_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 2:  # the step after the graphs' warm-up step and their capture
            raise torch.cuda.OutOfMemoryError(OOM)
        return step(*args, **kwargs)

    step = training.train_step
    capture = {"capture": no_capture, "replay": _fake_capture([]), "no graphs": None}[where]
    if capture is not None:
        monkeypatch.setattr(training, "capture_cuda_graphs", capture)
    if where != "capture":
        monkeypatch.setattr(training, "train_step", out_of_memory_step)
    args = layout_args("gpt2")
    args.enable_cuda_graph, args.cuda_graph_warmup_steps = where != "no graphs", 1
    if where == "no graphs":
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            train(args)
        assert "--cuda-graph-impl" not in str(info.value)
        return
    said = {"capture": "capturing the CUDA graphs after iteration 1", "replay": "iteration 2"}[where]
    with pytest.raises(TrainingError, match=re.escape(said) + ": out of GPU memory with CUDA graphs on .*"
                       "--cuda-graph-impl none keeps the layers eager .*" + re.escape(OOM)):
        train(args)


def test_the_log_says_how_a_tensor_parallel_run_launches_its_layers(monkeypatch):
    import io
    from contextlib import redirect_stdout
    from functools import partial

    from gpt_harness import TokenDataset, layout_args
    from parallel3d.training import gpt, pretrain
    from parallel3d.training.cuda_graphs import describe

    assert describe(_config(enable_cuda_graph=False)) is None  # one GPU, eager: nothing to say
    assert describe(_config(enable_cuda_graph=False, fp8="hybrid", bf16=True)).startswith(
        "layers launched eagerly (CUDA graphs, the default for TP and FP8 on GPUs, are off")
    assert describe(_config(tensor_model_parallel_size=2, sequence_parallel=True)) == (
        "TP=2 + SP, layers launched as CUDA graphs: captured after 3 eager steps, then replayed (--enable-cuda-graph)")
    assert describe(_config(tensor_model_parallel_size=2, enable_cuda_graph=False)).endswith(
        "layers launched eagerly (CUDA graphs, the default for TP and FP8 on GPUs, are off: --cuda-graph-impl none, a "
        "zero-bubble schedule, or CPU ranks)")
    assert describe(_config(tensor_model_parallel_size=2, enable_cuda_graph=False,
                            recompute_granularity="full")).endswith("are off: recompute_granularity (drop recomputation))")
    # pretrain prints it before training (one process with graphs here; the capture stands in, as above)
    from parallel3d.training import training

    monkeypatch.setattr(training, "capture_cuda_graphs", _fake_capture([]))
    args = layout_args("gpt2", iters=2)
    args.enable_cuda_graph = True
    config = gpt.transformer_config_from_args(args)
    partition = gpt.layer_partition(args, config)
    out = io.StringIO()
    with redirect_stdout(out):
        pretrain(args, partial(gpt.model_provider, config, partition), partial(gpt.forward_step, False),
                 lambda n: (TokenDataset(64), None, None), model_config=config,
                 layer_numbers=[[list(r) for r in chunks] for chunks in partition])
    assert "layers launched as CUDA graphs: captured after 3 eager steps" in out.getvalue()


def _replayed(module):
    """A stand-in for one captured layer: its backward computes what the graph would, but, as a replay, runs none
    of the layer's Python. So the fused weight gradient's flag is not set by it (a replay would not set it), and
    the placeholder gradient it returns for such a weight is NaN (a replay returns uninitialised memory)."""
    weights = [p for p in module.parameters() if p.requires_grad]
    busy = []  # a graph's activations are static: a forward before the last one's backward would overwrite them

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *_):
            if busy:
                raise RuntimeError("a captured layer replayed again before its last forward's backward")
            busy.append(True)
            with torch.enable_grad():
                ctx.x = x.detach().requires_grad_()
                ctx.out = module(ctx.x)
            return ctx.out.detach()

        @staticmethod
        def backward(ctx, grad):
            busy.clear()
            before = [getattr(p, "grad_added_to_main_grad", None) for p in weights]
            grads = list(torch.autograd.grad(ctx.out, [ctx.x] + weights, grad, allow_unused=True))
            for i, (p, flag) in enumerate(zip(weights, before), start=1):
                if getattr(p, "grad_added_to_main_grad", None) and not flag:  # set by the layer's Python
                    p.grad_added_to_main_grad = flag
                    grads[i] = torch.full_like(grads[i], float("nan"))
            return tuple(grads)

    return lambda x: Replay.apply(x, *weights)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_capture_bookkeeping_trains_like_eager(monkeypatch, family):
    """capture_cuda_graphs and LayerGraphs as they run on a GPU, with replays stood in for by layers that run
    none of their Python in backward (_replayed): the fused weight gradients' flags, found at the capture and
    set again by the output hooks, keep the DDP hooks from adding the placeholders. The same losses, gradient
    norms and weights as eager, and all four linears of every layer tracked."""
    from gpt_harness import GBS, ITERS, MBS, full_weights, layout_args, train
    from parallel3d.training import cuda_graphs, training

    made = []

    def capture(callables, samples, allow_unused_input):
        for module, (sample,) in zip(callables, samples):  # the capture's warm-up, as torch runs it
            inputs = [sample] + [p for p in module.parameters() if p.requires_grad]
            torch.autograd.grad(module(sample).sum(), inputs, allow_unused=allow_unused_input)
        made.append(callables)
        return tuple(_replayed(module) for module in callables)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", capture)
    captured = []

    def capture_blocks(model, micro_batch_size):
        count = cuda_graphs.capture_cuda_graphs(model, micro_batch_size)
        captured.extend(block.cuda_graphs for _, block in cuda_graphs._blocks(model))
        return count

    monkeypatch.setattr(training, "capture_cuda_graphs", capture_blocks)
    args = layout_args(family)
    args.enable_cuda_graph, args.cuda_graph_warmup_steps = True, 1
    graphed = train(args)
    eager = train(layout_args(family))
    assert graphed["losses"] == eager["losses"] and graphed["grad_norms"] == eager["grad_norms"]
    want = full_weights(eager)
    for name, got in full_weights(graphed).items():
        assert torch.equal(got, want[name]), name
    (layers,) = made
    assert len(layers) == len(graphed["model"][0].module.decoder.layers)
    (graphs,) = captured  # every layer's four linears write their weight gradient into main_grad
    assert [len(weights) for weights in graphs.fused] == [4] * len(layers)
    # training reports its replays: every micro-batch of the steps after the capture (the GPU suite asserts > 0)
    assert graphed["cuda_graph_replays"] == graphs.replayed == (ITERS - 1) * (GBS // MBS)
    assert eager["cuda_graph_replays"] == 0


# ------------------------------------------------------------------ pipeline parallelism, on gloo ranks

# (family, TP, PP, V, SP, extra flags); 4 ranks: 1F1B, interleaved, TP + SP with DP's overlapped reduction
PP_LAYOUTS = [("gpt2", 1, 2, 1, False, []), ("llama", 1, 2, 2, False, ["--use-distributed-optimizer"]),
              ("gpt2", 2, 2, 1, True, ["--overlap-grad-reduce"])]


def _with_graphs(args):
    args.enable_cuda_graph, args.cuda_graph_warmup_steps = True, 1


def _pipeline_sweep(rank, world_size, refs):
    """The layouts of PP_LAYOUTS with CUDA graphs stood in for (_replayed: a slot replayed again before its
    backward raises), against one process; returns (layouts done, slots captured per block, replays)."""
    from test_gpt_training import _sweep

    slots, replays = [], []

    def capture(callables, samples, allow_unused_input):
        for module, (sample,) in zip(callables, samples):
            inputs = [sample] + [p for p in module.parameters() if p.requires_grad]
            torch.autograd.grad(module(sample).sum(), inputs, allow_unused=allow_unused_input)
        # a block's captures follow one another; the block itself is kept, not its id(): a freed layout's
        # block can share its address with the next layout's, which would merge two runs of captures
        slots.append(callables[0].layer)
        stand_ins = tuple(_replayed(module) for module in callables)
        return tuple((lambda x, f=f: (replays.append(1), f(x))[1]) for f in stand_ins)

    eager = []
    take = LayerGraphs._take

    def counted_take(self, *args):
        slot = take(self, *args)
        if slot is None:
            eager.append(1)
        return slot

    torch.cuda.make_graphed_callables = capture  # this worker process only
    LayerGraphs._take = counted_take
    done = _sweep(rank, world_size, refs, PP_LAYOUTS, adjust=_with_graphs)
    per_block = [len(list(run)) for _, run in itertools.groupby(slots, key=id)]
    return done, per_block, len(replays), len(eager)


def test_pipeline_schedules_replay_each_forward_in_a_free_slot():
    """PP with graphs: each block is captured once per forward it had in flight in the warm-up step (1F1B's first
    stage holds two micro-batches), every later forward replays a slot no other micro-batch holds, and
    training equals one process (fp32 bounds) in 1F1B, interleaved, and TP + SP x PP with DP overlap."""
    from test_gpt_training import _reference
    from parallel3d.testing import run_distributed

    refs = {family: _reference(family) for family in ("gpt2", "llama")}
    results = run_distributed(_pipeline_sweep, 4, args=(refs,), timeout=300)
    for rank, (done, per_block, replays, eager) in enumerate(results):
        assert len(done) == len(PP_LAYOUTS), (rank, done)
        stage = rank // 2  # TP x DP = 2 ranks per stage in each layout
        # a block per chunk: 1F1B, then interleaved's two chunks, then 1F1B again
        one_f_one_b = [per_block[0], per_block[3]]
        assert one_f_one_b == [2 - stage] * 2, (rank, per_block)  # 1F1B's stage s holds PP - s micro-batches
        assert len(per_block) == 4 and min(per_block) >= 1, (rank, per_block)
        assert replays > 0 and eager == 0, (rank, replays, eager)  # after the capture, every forward replayed


def test_zero_bubble_schedules_are_refused_with_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for schedule in ("zb-h1", "auto"):
        flags = BASE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--enable-cuda-graph"]
        with pytest.raises(ArgumentError, match=re.escape(f"--enable-cuda-graph with --pipeline-schedule {schedule}")):
            validate_args(parse_args(flags), 2)
