"""Resuming in another layout (issue 30 items 4, 5): the first refusal gives the whole working command, a
converted checkpoint's layer split is taken, a checkpoint without optimizer or RNG state says so and names
the flags, a precision change names the flags and --no-load-optim."""
import shlex

import pytest

from gpt_harness import layout_args, train

from parallel3d.training import gpt
from parallel3d import parallel_state as ps
from parallel3d.testing import run_distributed
from parallel3d.tools.convert_checkpoint import convert, main as convert_main
from parallel3d.training import checkpointing
from parallel3d.training.checkpoint_args import take_checkpoint_split


def _pp2_balanced_then_converted(rank, world_size, save_dir, converted):
    import torch.distributed as dist

    ps.initialize_model_parallel(1, 2)
    try:
        args = layout_args("gpt2", 1, 2, world=world_size, iters=2)  # the balanced default: layers 0-6 | 7
        args.save, args.save_interval = save_dir, 2
        train(args)
        if rank == 0:  # the converter writes Megatron's even split: 0-3 | 4-7
            convert("parallel3d", "parallel3d", save_dir, converted, target_pipeline_parallel_size=2)
        dist.barrier()
        args = layout_args("gpt2", 1, 2, world=world_size, iters=4)
        args.load = converted
        partition = gpt.layer_partition(args, gpt.transformer_config_from_args(args))
        took = take_checkpoint_split(args, partition)  # what examples/pretrain_gpt.py does before training
        try:
            train(args)
            refused = None
        except checkpointing.CheckpointError as e:
            refused = str(e)
        args.no_load_optim = args.no_load_rng = True
        resumed = train(args)
        return took, refused, len(resumed["losses"]), [c.module.layer_numbers for c in resumed["model"]]
    finally:
        ps.destroy_model_parallel()


def test_a_converted_checkpoint_resumes_with_its_split_and_names_the_missing_state(tmp_path):
    save, converted = str(tmp_path / "pp2"), str(tmp_path / "converted")
    results = run_distributed(_pp2_balanced_then_converted, 2, args=(save, converted), timeout=300)
    for rank, (took, refused, resumed, layers) in enumerate(results):
        assert took == (f"--load {converted}: taking the checkpoint's layer split over the pipeline stages "
                        "(--pipeline-model-parallel-layout 'Etttt|ttttL')")
        assert refused == (f"{converted} (iteration 2) was saved without optimizer or RNG state (written by "
                           "tools/convert_checkpoint.py, which keeps the weights only): resume with --no-load-optim "
                           "--no-load-rng (the iteration and data position are kept), or with --finetune (its "
                           "weights, from iteration 0)")
        assert resumed == 2 and layers == [range(0, 4) if rank == 0 else range(4, 8)]

    # the same checkpoint on one process (PP 2 -> 1): the refusal's command, run as given, resumes
    args = layout_args("gpt2", iters=4)
    args.load = save
    with pytest.raises(checkpointing.CheckpointError) as e:
        train(args)
    message = str(e.value)
    assert "pipeline_model_parallel_size=2 but this run has 1; convert it: python3 tools/convert_checkpoint.py" \
        in message
    command = shlex.split(message.split("convert it: ")[1].split(", then resume with ")[0])
    assert command[:2] == ["python3", "tools/convert_checkpoint.py"]
    assert convert_main(command[2:] + ["--quiet"]) == 0
    flags = shlex.split(message.split(", then resume with ")[1].split(" (")[0])
    assert flags == ["--load", save + "_tp1_pp1", "--no-load-optim", "--no-load-rng"]
    args.load, args.no_load_optim, args.no_load_rng = flags[1], True, True
    assert len(train(args)["losses"]) == 2  # iterations 3 and 4


def test_a_checkpoint_without_rng_state_says_so(tmp_path):
    save = str(tmp_path / "one")
    args = layout_args("gpt2", iters=2)
    args.save, args.save_interval = save, 2
    train(args)
    converted = str(tmp_path / "converted")
    convert("parallel3d", "parallel3d", save, converted)
    ckpt = checkpointing.find_checkpoint_dir(converted, 2)
    model = train(layout_args("gpt2", iters=2))["model"]
    with pytest.raises(checkpointing.CheckpointError, match="holds no RNG state .written by tools/convert_checkpoint"
                       r".py, or saved with --no-save-rng.: resume with --no-load-rng") as e:
        checkpointing.load_checkpoint(converted, model, load_optimizer=False)
    assert str(e.value).startswith(ckpt) and "fewer ranks" not in str(e.value)


@pytest.mark.parametrize("saved,resumed,named", [
    (["--fp16"], ["--bf16"], "was saved with --fp16, this run has --bf16: the optimizer state's loss scaling "
                             "differs; resume with the checkpoint's --fp16, or add --no-load-optim"),
    (["--bf16"], ["--fp16"], "was saved with --bf16, this run has --fp16"),
])
def test_a_precision_change_names_the_flags_and_no_load_optim(tmp_path, saved, resumed, named):
    save = str(tmp_path / "ckpt")
    args = layout_args("gpt2", extra=saved, iters=2)
    args.save, args.save_interval = save, 2
    train(args)
    args = layout_args("gpt2", extra=resumed, iters=3)
    args.load = save
    with pytest.raises(checkpointing.CheckpointError, match=named):
        train(args)
    args.no_load_optim = True
    assert len(train(args)["losses"]) == 1

