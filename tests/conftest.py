"""Test-wide settings: hypothesis is derandomized by default so that CI is deterministic.

Explore new examples locally with `pytest --hypothesis-profile=explore`.
"""

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ci")
