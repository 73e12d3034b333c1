"""SPICE on Megatron-Core."""
