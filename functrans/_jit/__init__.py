"""Compile once, guard, cache, and run as one autograd node: jit and jit(module)."""
