"""Evaluation on the paper's benchmarks and analysis of runs."""
