"""Rollout engines (vLLM) for both SPICE roles, their HTTP service and the fleet client.

Layer 4: imports the shared modules and `bridge/` (the engines' side of a weight sync)."""
