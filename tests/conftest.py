"""Hypothesis profiles: ``ci`` (fits the test budget, the default) and ``nightly`` (make fuzz)."""

import os

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=40, **_COMMON)
settings.register_profile("nightly", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
