"""What crosses the wire between the trainer and the rollout engines: the request and answer types
(`types.py`) and the job's token, signatures and attestation (`auth.py`). Both sides import it, so
it sits below both: it imports nothing of the project but `entry.py`."""
