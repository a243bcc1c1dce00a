"""The `triton` kernel set: the contract's invariances on GPU tensor cores, with numerics of its own."""
