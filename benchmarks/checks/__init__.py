"""GPU correctness checks: kernels and interchange against references, on the real device."""
