"""The deadline loops keep: no step begun that the longest so far would carry past it."""

from __future__ import annotations

import time

from optpipe.solvers.clock import Clock


def test_no_deadline_always_allows():
    assert Clock(None).allows()


def test_a_step_as_long_as_the_longest_so_far_must_end_by_the_deadline():
    clock = Clock(time.monotonic() + 0.5)
    assert clock.allows()
    assert clock.timed(time.sleep, 0.02) is None
    assert clock.longest >= 0.02
    clock.longest = 1.0  # a step of a second no longer fits in the half second left
    assert not clock.allows()


def test_a_known_least_step_counts_before_any_step_is_timed():
    assert not Clock(time.monotonic() + 0.1, least_s=1.0).allows()
    assert Clock(time.monotonic() + 10.0, least_s=1.0).allows()


def test_a_failing_step_still_counts():
    clock = Clock(time.monotonic() + 10.0)

    def slow_failure():
        time.sleep(0.02)
        raise ValueError("no")

    try:
        clock.timed(slow_failure)
    except ValueError:
        pass
    assert clock.longest >= 0.02
