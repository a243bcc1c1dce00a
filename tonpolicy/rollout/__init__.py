"""Rollout side: the embedded engine (and, in other modules, its HTTP server and client)."""
