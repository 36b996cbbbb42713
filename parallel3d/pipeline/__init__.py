"""Pipeline parallelism: schedules as data, a validator/simulator, one executor.

    from parallel3d.pipeline import build_schedule, validate, simulate, get_forward_backward_func
"""
from .executor import PipelineGroup, ScheduleExecutor, custom_backward, deallocate_output_tensor
from .forward_backward import PipelineConfig, forward_backward, get_forward_backward_func
from .p2p import TensorSpec
from .registry import SCHEDULE_NAMES, SCHEDULES, build_schedule
from .builders import forward_only_schedule
from .schedules import Action, ActionKind, Schedule, ScheduleError, ScheduleRecord
from .simulate import SimResult, simulate, validate
