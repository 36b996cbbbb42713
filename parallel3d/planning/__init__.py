"""Cost model and layout planner: predict step time and memory of a TP x PP x DP layout.

    from parallel3d.planning import ModelSpec, Layout, get_cluster, estimate, search
    est = estimate(ModelSpec(...), Layout(...), get_cluster("h100-8x64"))

See docs/planning.md for the model and its assumptions, tools/plan.py for the command line.
"""
from .hardware import PRESETS, ClusterSpec, GemmCurve, get_cluster, load_cluster
from .memory import MemoryBreakdown
from .model import Layout, ModelSpec, model_flops, num_floating_point_operations, sc21_flops
from .step import StepEstimate, estimate, evaluate
