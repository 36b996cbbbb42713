"""Optimizers over DDP-wrapped model chunks (Megatron's ``megatron.core.optimizer``).

- ``FP32Optimizer``: fp32 parameters, stepped in place with ``main_grad`` as the gradient.
- ``MixedPrecisionOptimizer``: bf16/fp16 parameters with fp32 master copies; the
  step runs on the masters (fp32 gradients from ``main_grad``) and the result is
  copied back into the model. fp16 uses a loss scaler: a step with an Inf/NaN
  gradient on ANY rank is skipped on every rank and lowers the scale.
- ``DistributedOptimizer`` (ZeRO-1, ``distributed_optimizer.py``): masters and
  optimizer state only for this DP rank's shard of each bucket.

``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``.

State dicts are DP-size independent: per parameter (chunk index, parameter name)
the full fp32 master and optimizer-state tensors, plus the step count, the loss
scaler and the param groups' hyperparameters. A checkpoint written with ZeRO-1
at one DP size loads without ZeRO-1 or at another DP size. ``state_dict()`` is
collective under ZeRO-1 (every DP rank gathers, every DP rank gets the full dict).
Loading also writes the masters into the model parameters (rounded to their
dtype), so model and optimizer agree afterwards.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from parallel3d import parallel_state as ps
from parallel3d.collectives import all_reduce_over
from parallel3d.fused.adam import adamw_master_step, use_kernel as adam_kernel_applies
from parallel3d.model_chunk import is_first_stage_chunk, shared_weight

from .clip_grads import (
    clip_coefficient,
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    param_is_counted_in_grad_norm,
)
from .ddp import DistributedDataParallel
from .grad_scaler import ConstantGradScaler, DynamicGradScaler

_HALF = (torch.float16, torch.bfloat16)
_STATE_DICT_FORMAT = "parallel3d-optimizer-v1"
# Attributes the gradient-norm filter and the finalisation read; masters inherit them from their param.
_COPIED_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared")
# Group keys that describe the implementation, not the optimisation: never restored from a checkpoint.
_IMPLEMENTATION_KEYS = ("params", "foreach", "fused", "capturable", "differentiable", "maximize")


@dataclass
class OptimizerConfig:
    """Megatron's optimizer options (same names and defaults where Megatron has them)."""

    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """Clip to this global L2 norm; 0 turns clipping off (the norm is still computed and returned)."""
    bf16: bool = False
    fp16: bool = False
    params_dtype: torch.dtype = torch.float32
    loss_scale: Optional[float] = None
    """Constant loss scale; None with fp16 means dynamic loss scaling."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    log_num_zeros_in_grad: bool = False
    check_for_nan_in_grad: bool = False
    """Skip the update when the gradient norm is not finite (as an fp16 overflow does) rather than write
    NaN into the weights; the caller decides whether to stop (``--check-for-nan-in-loss-and-grad``)."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr is None or self.lr < 0:
            raise ValueError(f"lr must be set to a non-negative learning rate, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be in [0, lr={self.lr}]")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1) or self.adam_eps <= 0:
            raise ValueError(f"adam betas must be in [0, 1) and adam_eps > 0, got beta1={self.adam_beta1}, "
                             f"beta2={self.adam_beta2}, eps={self.adam_eps}")
        if self.sgd_momentum < 0:
            raise ValueError(f"sgd_momentum must be >= 0, got {self.sgd_momentum}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 cannot both be set")
        expected = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32
        if self.params_dtype != expected:
            raise ValueError(f"params_dtype {self.params_dtype} disagrees with bf16={self.bf16}, fp16={self.fp16} "
                             f"(expected {expected})")
        if self.loss_scale is not None and not (self.fp16 or self.bf16):
            raise ValueError(f"loss_scale={self.loss_scale} only applies to fp16/bf16 training")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale must be positive, got {self.loss_scale}")
        if self.fp16 and self.loss_scale is None:
            if not 0 < self.min_loss_scale <= self.initial_loss_scale:
                raise ValueError(f"min_loss_scale ({self.min_loss_scale}) must be in (0, initial_loss_scale="
                                 f"{self.initial_loss_scale}]")
            if self.loss_scale_window < 1 or self.hysteresis < 1:
                raise ValueError(f"loss_scale_window ({self.loss_scale_window}) and hysteresis ({self.hysteresis}) "
                                 "must be >= 1")


def _make_grad_scaler(config: OptimizerConfig):
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=int(config.loss_scale_window),
                                 hysteresis=config.hysteresis)
    return None


def _copy_attributes(main: torch.Tensor, param: torch.Tensor) -> None:
    for attr in _COPIED_ATTRIBUTES:
        if hasattr(param, attr):
            setattr(main, attr, getattr(param, attr))


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default: biases and 1-D parameters (norms) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def _unscale_and_check(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: float) -> None:
    """grads *= inv_scale; found_inf = 1 if any grad holds an Inf/NaN (one fused kernel where torch has it)."""
    inv = torch.tensor(inv_scale, dtype=torch.float32, device=found_inf.device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
    except (RuntimeError, NotImplementedError):
        if found_inf.is_cuda:
            raise
        # CPU builds of older torch lack the kernel
        if any(not bool(torch.isfinite(g).all()) for g in grads):
            found_inf.fill_(1.0)
        torch._foreach_mul_(grads, inv_scale)


class MegatronOptimizer:
    """The step shared by all optimizers: grads -> unscale / inf check -> norm and clip -> step -> copy back.

    Subclasses provide the fp32 "main" parameters the torch optimizer steps, their
    gradients, and the copy back into the model.
    """

    def __init__(self, config: OptimizerConfig, model_chunks: Sequence[DistributedDataParallel],
                 state: Optional[ps.ParallelState] = None):
        self.config = config
        self.model_chunks = list(model_chunks)
        state = ps.resolve_parallel_state(state)
        self.tp_rank = state.tensor_model_parallel_rank
        self.model_parallel_group = state.model_parallel_group
        self.data_parallel_group = self.model_chunks[0].dp_group
        self.grad_scaler = _make_grad_scaler(config)
        self.num_steps = 0  # successful steps
        self.device = self.model_chunks[0].param_and_grad_buffers[0].device
        # The tied word embedding's copy on a later stage: counted once in norms (on the first stage).
        self._shared_copies: set = set()
        for chunk in self.model_chunks:
            w = shared_weight(chunk.module)
            if w is not None and not is_first_stage_chunk(chunk.module):
                self._shared_copies.add(w)
        self.optimizer: torch.optim.Optimizer  # built by the subclass with _build_torch_optimizer

    # ------------------------------------------------------------------ construction helpers
    def _named_trainable_params(self) -> Iterator[tuple[int, str, nn.Parameter]]:
        for ci, chunk in enumerate(self.model_chunks):
            for name, p in chunk.module.named_parameters():
                if p.requires_grad:
                    yield ci, name, p

    def _make_main(self, main: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        _copy_attributes(main, param)
        if param in self._shared_copies:
            main.shared = True
        return main

    def _build_torch_optimizer(self, decay: list, no_decay: list) -> torch.optim.Optimizer:
        c = self.config
        groups = [
            {"params": decay, "weight_decay": c.weight_decay, "wd_mult": 1.0, "lr_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0},
        ]
        params = decay + no_decay
        cls = torch.optim.AdamW if c.optimizer == "adam" else torch.optim.SGD
        # The fused kernels need CUDA tensors (and SGD's exists from torch 2.4 on); else the foreach path.
        fused = (bool(params) and all(p.is_cuda for p in params)
                 and "fused" in inspect.signature(cls.__init__).parameters)
        impl = {"fused": True} if fused else {"foreach": True}
        if c.optimizer == "adam":
            return cls(groups, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps, **impl)
        return cls(groups, lr=c.lr, momentum=c.sgd_momentum, **impl)

    def _state_keys(self) -> tuple[str, ...]:
        if self.config.optimizer == "adam":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.config.sgd_momentum > 0 else ()

    # ------------------------------------------------------------------ subclass interface
    def _main_params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _copy_model_grads_to_main_grads(self) -> None:
        raise NotImplementedError

    def _copy_main_params_to_model_params(self) -> None:
        raise NotImplementedError

    def _publish_model_params(self) -> None:
        """The updated masters into the model's parameters. The copies write through ``.data`` or the
        parameter buffer, which autograd does not see: bumping the parameters' versions tells caches keyed
        on them (the FP8 weight cache, tensor_parallel/fp8.py) that the weights changed."""
        self._copy_main_params_to_model_params()
        self._bump_model_param_versions()

    def _bump_model_param_versions(self) -> None:
        for p in (p for chunk in self.model_chunks for p in chunk.parameters()):
            torch.autograd.graph.increment_version(p)  # one tensor a call: torch 2.3 takes no list

    def _grad_stats_groups(self) -> tuple:
        """Groups over which gradient statistics (norm, zeros) are summed."""
        raise NotImplementedError

    def reload_model_params(self) -> None:
        """Copy the model's parameters into the fp32 masters (after loading model weights)."""
        raise NotImplementedError

    def _gather_named_state(self) -> dict:
        raise NotImplementedError

    def _load_named_state(self, params: dict) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ public API
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        scale = 1.0 if self.grad_scaler is None else self.grad_scaler.scale
        return torch.tensor(scale, dtype=torch.float32, device=self.device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the DDP gradient buffers of every chunk (main_grad) and drop the masters' gradients."""
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self._release_main_grads()

    def _release_main_grads(self) -> None:
        for p in self._main_params():
            p.grad = None

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        """Unscale in place and report whether any rank of the TP x PP x DP world saw an Inf/NaN."""
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        if grads:
            _unscale_and_check(grads, found, self.grad_scaler.inv_scale)
        # Non-ZeRO grads are already identical across DP, but an Inf that appeared on one
        # rank after the reduction must still stop every rank, or the replicas diverge.
        all_reduce_over(found, dist.ReduceOp.MAX, (self.model_parallel_group, self.data_parallel_group))
        return bool(found.item() > 0)

    @torch.no_grad()
    def step(self) -> tuple[bool, Optional[float], Optional[int]]:
        self._copy_model_grads_to_main_grads()
        mains = self._main_params()
        grads = [p.grad for p in mains]
        if self.grad_scaler is not None:
            found_inf = self._found_inf(grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._release_main_grads()
                return False, None, None
        groups = self._grad_stats_groups()
        grads_for_norm = [p.grad for p in mains if param_is_counted_in_grad_norm(p, self.tp_rank)]
        grad_norm = get_grad_norm_fp32(grads_for_norm, 2.0, groups, self.device)
        if self.config.check_for_nan_in_grad and not math.isfinite(grad_norm):
            self._release_main_grads()  # the norm is a host float already: the check costs no sync
            return False, grad_norm, None
        num_zeros = count_zeros_fp32(grads_for_norm, groups, self.device) if self.config.log_num_zeros_in_grad \
            else None
        if self._fused_step(clip_coefficient(self.config.clip_grad, grad_norm)):
            self._release_main_grads()
            self._bump_model_param_versions()
        else:
            clip_grad_by_total_norm_fp32(grads, self.config.clip_grad, grad_norm)
            self.optimizer.step()
            self._release_main_grads()
            self._publish_model_params()
        self.num_steps += 1
        return True, grad_norm, num_zeros

    def _fused_step(self, grad_scale: float) -> bool:
        """The clip (``grad_scale``), the update and the copy into the model in one pass, where a subclass
        can: True if it ran. Else the three run apart."""
        return False

    # ------------------------------------------------------------------ checkpoints
    def _set_optimizer_state(self, main: torch.Tensor, tensors: dict[str, torch.Tensor], step: int) -> None:
        if step == 0:
            self.optimizer.state.pop(main, None)  # never stepped: a fresh state is exactly right
            return
        state = {k: t.to(device=main.device, dtype=main.dtype).clone() for k, t in tensors.items()}
        if self.config.optimizer == "adam":
            group = self.optimizer.param_groups[0]  # every group is built with the same implementation flags
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=main.device if on_device else None)
        self.optimizer.state[main] = state

    def _state_tensors(self, main: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.optimizer.state.get(main, {})
        return {k: (state[k].detach().float() if k in state else torch.zeros_like(main, dtype=torch.float32))
                for k in self._state_keys()}

    def state_dict(self) -> dict:
        return {
            "format": _STATE_DICT_FORMAT,
            "optimizer": self.config.optimizer,
            "step": self.num_steps,
            "param_groups": [{k: v for k, v in g.items() if k not in _IMPLEMENTATION_KEYS}
                             for g in self.optimizer.param_groups],
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "params": self._gather_named_state(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("format") != _STATE_DICT_FORMAT:
            raise ValueError(f"not a parallel3d optimizer state dict (format={state_dict.get('format')!r}, "
                             f"expected {_STATE_DICT_FORMAT!r})")
        if state_dict["optimizer"] != self.config.optimizer:
            raise ValueError(f"checkpoint holds {state_dict['optimizer']!r} state, this optimizer is "
                             f"{self.config.optimizer!r}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}")
        self.num_steps = int(state_dict["step"])
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            for k, v in saved.items():
                if k in group and k not in _IMPLEMENTATION_KEYS:
                    group[k] = v
        if (self.grad_scaler is None) != (state_dict["grad_scaler"] is None):
            raise ValueError("checkpoint and optimizer disagree on loss scaling (one has a grad scaler, the other not)")
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._load_named_state(state_dict["params"])
        self._publish_model_params()

    def _saved_entry(self, params: dict, ci: int, name: str, shape: torch.Size) -> dict:
        try:
            entry = params[ci][name]
        except KeyError:
            raise KeyError(f"optimizer checkpoint has no state for chunk {ci} parameter {name!r}") from None
        for k in ("main_param",) + self._state_keys():
            if k not in entry:
                raise KeyError(f"optimizer checkpoint lacks {k!r} for chunk {ci} parameter {name!r}")
            if entry[k].shape != shape:
                raise ValueError(f"chunk {ci} parameter {name!r}: checkpoint {k} has shape {tuple(entry[k].shape)}, "
                                 f"the model {tuple(shape)} (a different TP/PP layout?)")
        return entry


class MixedPrecisionOptimizer(MegatronOptimizer):
    """bf16/fp16 parameters stepped through fp32 masters; fp32 parameters (if any) are stepped in place."""

    def __init__(self, config: OptimizerConfig, model_chunks: Sequence[DistributedDataParallel],
                 state: Optional[ps.ParallelState] = None):
        super().__init__(config, model_chunks, state)
        self.keys: list[tuple[int, str]] = []
        self.model_params: list[nn.Parameter] = []
        self.main_params: list[torch.Tensor] = []
        decay, no_decay = [], []
        for ci, name, p in self._named_trainable_params():
            # fp32 parameters are their own masters (get_megatron_optimizer admits fp32, bf16 and fp16 only)
            main = self._make_main(p.detach().clone().float() if p.dtype in _HALF else p, p)
            self.keys.append((ci, name))
            self.model_params.append(p)
            self.main_params.append(main)
            (no_decay if no_weight_decay(name, p) else decay).append(main)
        self._half_pairs = [(p, m) for p, m in zip(self.model_params, self.main_params) if p is not m]
        self.optimizer = self._build_torch_optimizer(decay, no_decay)

    def _main_params(self) -> list[torch.Tensor]:
        return self.main_params

    def _copy_model_grads_to_main_grads(self) -> None:
        for p, main in zip(self.model_params, self.main_params):
            g = p.main_grad
            main.grad = g if g.dtype == torch.float32 else g.float()  # fp32: an alias, no copy

    def _release_main_grads(self) -> None:
        super()._release_main_grads()
        for p in self.model_params:
            p.grad = None

    def _copy_main_params_to_model_params(self) -> None:
        if self._half_pairs:
            torch._foreach_copy_([p.data for p, _ in self._half_pairs], [m for _, m in self._half_pairs])

    @torch.no_grad()
    def _fused_step(self, grad_scale: float) -> bool:
        """Adam on GPUs with the CUDA kernels: fused.adamw_master_step, group by group, the masters with a
        half-precision model copy apart from the fp32 parameters that are their own masters. The state is the
        torch optimizer's (its checkpoints and its own step() read the same tensors)."""
        if self.config.optimizer != "adam":
            return False
        model_of = {id(m): p for p, m in self._half_pairs}
        calls = []
        for group in self.optimizer.param_groups:
            for half in (True, False):
                mains = [m for m in group["params"] if (id(m) in model_of) == half]
                if mains:
                    calls.append((group, mains, [model_of[id(m)].data for m in mains] if half else []))
        tensors = [m for _, mains, _ in calls for m in mains]
        if not tensors or not adam_kernel_applies((tensors, [m.grad for m in tensors]),
                                                  [p for _, _, ps in calls for p in ps]):
            return False
        step = self.num_steps + 1  # the masters step together: every state's step is num_steps
        for group, mains, models in calls:
            states = [self._adam_state(m) for m in mains]
            beta1, beta2 = group["betas"]
            adamw_master_step(mains, [m.grad for m in mains], [s["exp_avg"] for s in states],
                              [s["exp_avg_sq"] for s in states], models, group["lr"], beta1, beta2, group["eps"],
                              group["weight_decay"], step, grad_scale)
            torch._foreach_add_([s["step"] for s in states], 1.0)
        return True

    def _adam_state(self, main: torch.Tensor) -> dict:
        """The torch optimizer's state of ``main``, created as its fused AdamW creates it on a first step."""
        state = self.optimizer.state[main]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=main.device)
            state["exp_avg"] = torch.zeros_like(main, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(main, memory_format=torch.preserve_format)
        return state

    def _grad_stats_groups(self) -> tuple:
        return (self.model_parallel_group,)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        for p, main in self._half_pairs:
            main.copy_(p.data)

    def _gather_named_state(self) -> dict:
        params: dict = {}
        for (ci, name), main in zip(self.keys, self.main_params):
            entry = {"main_param": main.detach().float().clone()}
            entry.update({k: t.clone() for k, t in self._state_tensors(main).items()})
            params.setdefault(ci, {})[name] = entry
        return params

    @torch.no_grad()
    def _load_named_state(self, params: dict) -> None:
        for (ci, name), main in zip(self.keys, self.main_params):
            entry = self._saved_entry(params, ci, name, main.shape)
            main.copy_(entry["main_param"])
            self._set_optimizer_state(main, {k: entry[k] for k in self._state_keys()}, self.num_steps)


class FP32Optimizer(MixedPrecisionOptimizer):
    """All parameters fp32: the torch optimizer steps the model parameters themselves (no copies).

    What get_megatron_optimizer builds for a config without bf16 / fp16, whose chunks it checked hold fp32
    parameters only; the steps are MixedPrecisionOptimizer's, with no half-precision pair to copy."""
