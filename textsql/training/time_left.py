"""How long a training run has left, from its own measured pace once that is steady.

The first steps of a run carry its start-up (model load, DeepSpeed's engine, a compile on the first step) and
its first evaluation compiles generation too: a rate that counted them would promise too much time left, then
shrink for minutes. So the steady window starts where that is behind it: after the first evaluation and the
checkpoint saved with it (:func:`steady_from`). From there the pace is the window's time a step plus its
evaluations' and checkpoints' time spread over the steps between them, so their cost is spread over the steps
that remain as the run's own schedule spreads it (a step-grid schedule or one timed by share and minutes alike).
Until a second evaluation or checkpoint falls in the window the pace is the steps' alone.

Observations are ``(step, time)``: a step done at that time, or (the same step again) a pause after it
(evaluation, checkpoint) done then; a pause after the last step is ignored, as no step is left to spread it
over. Pure: the caller brings the clock.

Usage::

    >>> left = TimeLeft(max_steps=1000, steady_from=100)
    >>> left.observe(10, 60.0); left.observe(100, 150.0); left.observe(100, 160.0); left.observe(200, 260.0)
    >>> left.seconds_left()
    800.0
"""

from __future__ import annotations

from dataclasses import dataclass, field


def steady_from(start: int, max_steps: int, eval_every: int | None, save_every: int | None) -> int:
    """The step whose pauses end the run's start-up: its first evaluation after ``start``, else its first
    checkpoint, else ``start`` itself (the first observation then opens the window) when neither comes before
    the last step.

    :param start: the step training starts from (a resumed run's checkpoint, else 0).
    :param max_steps: the run's last step.
    :param eval_every: steps between evaluations (None: the run does not evaluate).
    :param save_every: steps between checkpoints (None: it saves none on the way).
    :rtype: int
    """
    for every in (eval_every, save_every):
        if every:
            first = (start // every + 1) * every
            if first < max_steps:
                return first
    return start


@dataclass
class TimeLeft:
    """The time left of a run of ``max_steps`` whose steady window opens at ``steady_from`` (:func:`steady_from`).

    :param max_steps: the run's last step.
    :param steady_from: the step after whose last observation the window opens.
    """

    max_steps: int
    steady_from: int
    # The window's first observation (step, time), and the latest one.
    opened: tuple[int, float] | None = field(default=None, init=False)
    latest: tuple[int, float] | None = field(default=None, init=False)
    # Seconds of the window's pauses, and the step of its latest pause.
    paused_s: float = field(default=0.0, init=False)
    paused_at: int | None = field(default=None, init=False)

    def observe(self, step: int, now: float) -> None:
        """Step ``step`` was done at ``now``, or (observed again) a pause after it ended then.

        :param step: the optimizer step.
        :param now: seconds on the caller's clock.
        """
        if step >= self.max_steps and self.latest is not None and self.latest[0] == step:
            # Work after the last step (its evaluation, the model's save) is no pause of the run: no step is left
            # to spread it over, and the steps' pace is what run.json keeps.
            return
        if step >= self.steady_from and (self.opened is None or self.opened[0] == step):
            # The pauses of the window's first step (evaluation, then checkpoint) are still start-up.
            self.opened = (step, now)
        elif self.opened is not None and self.latest is not None and self.latest[0] == step:
            self.paused_s += now - self.latest[1]
            self.paused_at = step
        self.latest = (step, now)

    def seconds_per_step(self) -> float | None:
        """The steady pace: the window's seconds a step, plus its pauses spread over the steps between them
        (whole periods only, so a period whose pause is still to come does not thin them out); None before the
        window has a step.

        :rtype: float | None
        """
        if self.opened is None or self.latest is None or self.latest[0] <= self.opened[0]:
            return None
        stepping = (self.latest[1] - self.opened[1] - self.paused_s) / (self.latest[0] - self.opened[0])
        if self.paused_at is None:
            return stepping
        return stepping + self.paused_s / (self.paused_at - self.opened[0])

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until ``max_steps``: the steps left at the steady pace, less the time since the latest
        observation; None until the pace is steady.

        :param now: the time to count down to (None: the latest observation's).
        :rtype: float | None
        """
        pace = self.seconds_per_step()
        if pace is None or self.latest is None:
            return None
        since = 0.0 if now is None else now - self.latest[1]
        return max(0.0, (self.max_steps - self.latest[0]) * pace - since)
