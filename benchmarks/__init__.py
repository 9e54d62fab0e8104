"""Benchmarks for functrans: a model zoo and partition quality/speed comparisons with torch.

Run them as modules from the repository root, e.g. ``python -m benchmarks.partition_quality``.
"""
