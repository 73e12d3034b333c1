"""The Megatron-Core learner: model, parallel state, log-probs, train step, checkpoints.

Layer 3: imports the shared modules and `selfplay/` (DrGRPO's loss)."""
