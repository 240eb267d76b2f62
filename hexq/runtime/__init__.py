"""Serving under a hard memory budget: the mixed-precision expert cache, its prefetch worker and the cost model."""

from hexq.runtime.cache import (
    BudgetTracker,
    CacheStats,
    ExpertCache,
    ExpertHandle,
    ExpertSource,
    ExpertVersion,
    ExpertWeights,
)
from hexq.runtime.cost import LatencyProfile, measure_latency, n_critical, should_fill

__all__ = [
    "BudgetTracker",
    "CacheStats",
    "ExpertCache",
    "ExpertHandle",
    "ExpertSource",
    "ExpertVersion",
    "ExpertWeights",
    "LatencyProfile",
    "measure_latency",
    "n_critical",
    "should_fill",
]
