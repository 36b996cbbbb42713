"""The suite's device rule (README, "Tests"): the tests outside tests/gpu run on the CPU on every
machine, with gloo ranks; their single-process references are then exact, and a machine with GPUs
passes them as CI does. tests/gpu proves the same on CUDA with NCCL, one process per GPU, and starts
its processes with PARALLEL3D_DEVICE=cuda."""
import os

os.environ["PARALLEL3D_DEVICE"] = "cpu"
