"""Rollout engines (vLLM) for both SPICE roles, their HTTP service and the fleet client."""
