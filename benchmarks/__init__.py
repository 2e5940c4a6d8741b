"""Measurement: memory and time of a training step per framework and checkpoint policy.

Entry point: ``python -m benchmarks.compare --help``.
"""
