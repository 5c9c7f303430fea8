"""Dynamic loss scaling for fp16: keep small gradients representable, skip steps that overflow.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by S before
backward shifts every gradient up by S; the optimizer sees them divided by S again. If any
gradient overflowed (inf/nan anywhere in the *global* norm, so every rank decides the same),
the step is skipped and S halves; after ``growth_interval`` clean steps S doubles.
"""

from __future__ import annotations

import math


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 200, enabled: bool = True):
        self.scale = init_scale if enabled else 1.0
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, grad_norm: float) -> bool:
        """Record this step's (scaled) global gradient norm; return True if the step must be skipped."""
        if not self.enabled:
            return False
        if not math.isfinite(grad_norm):
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            return True
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]
