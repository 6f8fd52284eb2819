"""Shared test settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Deterministic in CI: the same examples every run, no flaky deadline failures.
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
