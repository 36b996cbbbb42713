"""Learning-rate and weight-decay schedule (Megatron's OptimizerParamScheduler).

One ``step()`` per optimizer step: linear warmup from ``init_lr`` to ``max_lr``
over ``lr_warmup_steps``, then decay to ``min_lr`` at ``lr_decay_steps`` (Megatron's
``--lr-warmup-iters`` / ``--lr-decay-iters`` when one step is one iteration), and
``min_lr`` afterwards. Each param group's lr is multiplied by its ``lr_mult`` and its
weight decay by its ``wd_mult`` (0 for biases and norms).
"""
from __future__ import annotations

import math
from typing import Optional

_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential")
_WD_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ):
        if lr_decay_style not in _DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {_DECAY_STYLES}, got {lr_decay_style!r}")
        if wd_incr_style not in _WD_STYLES:
            raise ValueError(f"wd_incr_style must be one of {_WD_STYLES}, got {wd_incr_style!r}")
        if not 0.0 <= min_lr <= max_lr or init_lr < 0:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr}) and init_lr ({init_lr}) >= 0")
        if lr_warmup_steps < 0 or lr_decay_steps <= 0:
            raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be >= 0 and lr_decay_steps "
                             f"({lr_decay_steps}) > 0")
        if lr_decay_style != "constant" and lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be < lr_decay_steps ({lr_decay_steps})")
        if start_wd < 0 or end_wd < start_wd:
            raise ValueError(f"need 0 <= start_wd ({start_wd}) <= end_wd ({end_wd})")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(f"wd_incr_style='constant' needs start_wd == end_wd, got {start_wd} and {end_wd}")
        if wd_incr_steps <= 0 and wd_incr_style != "constant":
            raise ValueError(f"wd_incr_steps must be > 0 for wd_incr_style={wd_incr_style!r}, got {wd_incr_steps}")
        if lr_decay_style == "WSD":
            if lr_wsd_decay_style not in _WSD_STYLES:
                raise ValueError(f"lr_wsd_decay_style must be one of {_WSD_STYLES} for WSD, got "
                                 f"{lr_wsd_decay_style!r}")
            if wsd_decay_steps is None or not 0 < wsd_decay_steps <= lr_decay_steps - lr_warmup_steps:
                raise ValueError(f"WSD needs 0 < wsd_decay_steps ({wsd_decay_steps}) <= lr_decay_steps - "
                                 f"lr_warmup_steps ({lr_decay_steps - lr_warmup_steps})")
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = float(init_lr), float(max_lr), float(min_lr)
        # the warmup as given: Megatron's --lr-warmup-fraction makes it a fraction of the decay samples
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = int(wd_incr_steps), wd_incr_style
        self.num_steps = 0
        self.step(0)

    def get_wd(self) -> float:
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict) -> float:
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup, steps = max(self.lr_warmup_steps, 1), max(self.num_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(steps))
        ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                r = (self.num_steps - anneal_start) / self.wsd_decay_steps
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - r
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
                else:
                    coeff = 2.0 * math.pow(0.5, r) - 1.0
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    _STATE_KEYS = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                   "wsd_decay_steps", "lr_wsd_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style",
                   "num_steps")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE_KEYS}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the schedule from the checkpoint (Megatron's use_checkpoint_opt_param_scheduler)."""
        missing = [k for k in self._STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(f"scheduler state dict lacks {missing}")
        for k in self._STATE_KEYS:
            setattr(self, k, state_dict[k])
        self.step(0)
