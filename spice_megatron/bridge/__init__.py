"""Weights between Hugging Face checkpoints, the Megatron learner and the rollout engines."""
