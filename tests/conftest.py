"""Hypothesis profiles: ``ci`` (fits the test budget, the default) and ``nightly`` (make fuzz)."""

import os

# The suite compiles thousands of throwaway functions: keep them out of the on-disk trace cache
# (tests/jit/test_disk_cache.py turns it on in its own folders). FUNCTRANS_CACHE=1 with a fresh
# FUNCTRANS_CACHE_DIR, run twice, runs the suite through the cache: a soundness check.
os.environ.setdefault("FUNCTRANS_CACHE", "0")

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=40, **_COMMON)
# nightly: 1000 examples, heavy properties a fraction (their @settings), `make fuzz` on 2 xdist
# workers: ~2600 s of work measured at 100 examples, ~40 min expected on 2 cores.
# FUNCTRANS_FUZZ_EXAMPLES overrides the count (a short run to measure per-example costs)
settings.register_profile(
    "nightly", max_examples=int(os.environ.get("FUNCTRANS_FUZZ_EXAMPLES", "1000")), **_COMMON
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
