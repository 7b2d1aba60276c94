"""Helpers for tests that share the session's Ray cluster (conftest `ray_cluster`)."""

from __future__ import annotations

import time


def wait_for_free_cpus(ray, timeout: float = 30.0) -> float:
    """Wait until every CPU of the cluster is free again, and return how many that is.

    Ray frees a killed actor's CPUs a moment after `ray.kill` returns: a test that reads
    `available_resources()` right after the previous test's engine closed reads fewer CPUs
    than the engine it starts will find.
    """
    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0.0) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {ray.available_resources()} of {ray.cluster_resources()} "
                               f"are free after {timeout} s: a test left an actor running")
        time.sleep(0.1)
    return total
