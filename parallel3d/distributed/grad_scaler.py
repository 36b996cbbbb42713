"""Loss scaling for fp16 training (Megatron's ConstantGradScaler / DynamicGradScaler).

The scale is a Python float: the optimizer must read the found-inf flag on the
host anyway to decide whether to skip the step, so a device-resident scale
would save nothing. The settings are OptimizerConfig's, validated there (the optimizer builds the scaler).
"""
from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, initial_scale: float):
        self._scale = float(initial_scale)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = float(state_dict["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Halve the scale after ``hysteresis`` overflowing steps, double it after ``growth_interval`` clean ones.

    An overflow resets the growth count; the hysteresis budget is refilled only
    when the scale grows (Megatron's behaviour).
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
