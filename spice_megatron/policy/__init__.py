"""The Megatron-Core learner: model, parallel state, log-probs, train step, checkpoints."""
