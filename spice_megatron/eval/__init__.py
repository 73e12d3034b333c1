"""Evaluation on the paper's benchmarks and analysis of runs.

Layer 5: imports every layer below it, and `run/` beside it (the run logs it reads); never `plan/` or the loop."""
