"""Operator benchmarks: one kernel or op at production shapes, against its other forms."""
