"""Benchmarks: scripts that print a rich table and save JSON under benchmarks/results/.

Never part of the test suite's pass/fail: timings on a shared machine are noisy, so figures are
quoted as ratios measured in one run.
"""
