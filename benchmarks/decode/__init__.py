"""Decode benchmarks: long-context inference and the kernels a decode step launches."""
