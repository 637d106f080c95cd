"""Training-step benchmarks: the whole step, the optimizer update, compile-time memory."""
