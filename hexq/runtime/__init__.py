"""Serving under a hard memory budget: the mixed-precision expert cache, its prefetch worker and the cost model."""
