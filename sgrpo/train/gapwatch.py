"""A warning when the sampler-trainer log-prob gap jumps far above its running level.

An external sampler (vLLM) that stops receiving the policy's weights keeps sampling from an old copy:
nothing fails, but ``train/rollout/mismatch_abs_diff`` climbs from rounding level (1e-3 - 1e-2 nats)
to 0.5-1 within a few steps. ``GapWatch`` turns that jump into a warning.
"""

from __future__ import annotations

import math


class GapWatch:
    """Flags steps whose gap ``g_t`` is ``factor`` times above the running level, and warns about them.

    The level is an exponential moving average of the steps that were not flagged,
    ``L_t = (1 - alpha) L_{t-1} + alpha g_t`` (``L_1 = g_1``), so a lasting jump does not become the new
    normal. Step ``t`` is flagged when at least ``warmup`` steps set the level and
    ``g_t > factor * max(L_{t-1}, floor)`` (``floor`` keeps float rounding, 1e-7 in float32, from
    making a 1e-5 wobble a "jump"). A non-finite gap is always flagged. The warning is given at the
    first flagged step of a run of flagged steps, then every ``every`` steps while the run lasts.
    """

    def __init__(
        self, factor: float = 10.0, floor: float = 1e-3, alpha: float = 0.1, warmup: int = 3, every: int = 50
    ) -> None:
        if factor <= 1 or floor <= 0 or not 0 < alpha <= 1 or warmup < 1 or every < 1:
            raise ValueError("GapWatch needs factor > 1, floor > 0, 0 < alpha <= 1, warmup >= 1 and every >= 1")
        self.factor, self.floor, self.alpha, self.warmup, self.every = factor, floor, alpha, warmup, every
        self.level: float | None = None
        self.seen = 0  # steps that set the level
        self.warned_at: int | None = None  # step of the last warning of the current run of flagged steps

    def observe(self, step: int, gap: float) -> str | None:
        """Take step ``step``'s mean |d log p|; returns the warning when one is due, else None (the caller logs it)."""
        flagged = not math.isfinite(gap) or (
            self.level is not None and self.seen >= self.warmup and gap > self.factor * max(self.level, self.floor)
        )
        if not flagged:
            self.level = gap if self.level is None else (1 - self.alpha) * self.level + self.alpha * gap
            self.seen += 1
            self.warned_at = None
            return None
        if self.warned_at is not None and step - self.warned_at < self.every:
            return None
        self.warned_at = step
        message = (
            f"step {step}: the sampler-trainer log-prob gap (mean |d log p|) is {gap:.4g}, "
            f"{gap / max(self.level or 0.0, self.floor):.0f}x its running level {self.level or 0.0:.3g}: the rollout "
            "engine may be sampling from stale weights (a weight sync that failed silently); "
            f"repeated every {self.every} steps while it lasts"
        )
        return message
