"""Repeated, alternated measurement of two or more arms, summarised by the median."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)


def alternate(arms: Mapping[str, Callable[[], float]], repetitions: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every arm ``warmup`` times (discarded), then ``repetitions`` rounds of all arms.

    The order of the arms flips every round, so a slow drift of the shared machine (another
    developer's test starting) weighs on each arm alike.

    :param arms: name -> a callable that runs the arm once and returns its rate (units per second).
    :param repetitions: measured rounds.
    :param warmup: unmeasured rounds first (lazy initialisation, caches, allocator).
    :returns: name -> the measured rates, in run order.
    :rtype: dict[str, list[float]]
    """
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repetitions):
        for name in names if round_index % 2 == 0 else reversed(names):
            rates[name].append(arms[name]())
            logger.info("  %s round %d: %.3g/s", name, round_index + 1, rates[name][-1])
    return rates


def summary(values: list[float], digits: int = 4) -> dict:
    """Median, min, max and every value of a list of measurements.

    :rtype: dict
    """
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(value, digits) for value in values],
    }


def ratio(numerator: list[float], denominator: list[float], digits: int = 2) -> float:
    """Ratio of the medians of two lists of rates.

    :rtype: float
    """
    return round(statistics.median(numerator) / statistics.median(denominator), digits)


def rounded(value: float | None, digits: int = 4) -> float | None:
    """``value`` rounded, or ``None`` (a figure that could not be measured) as it is.

    :rtype: float | None
    """
    return None if value is None else round(value, digits)
