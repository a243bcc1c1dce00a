"""The `plain` kernel set: plain torch ops, the negative control (no invariance promised)."""
