"""The learner's first forward during a streamed iteration's rollouts (disaggregated, on-policy).

With several optimizer steps per batch (train.trajectories_per_update or steps_per_batch > 1) and
train.old_logprobs=forward, the learner runs every trained sequence once before its first step, for
the PPO ratio's old log-probs. Disaggregated, it would idle through the rollouts and then run that
forward over the whole batch; streamed, each document is complete well before the last one, so the
learner runs the old log-probs of the documents already complete while the others roll out, and only
the last ones' forward and the optimizer steps remain after the last rollout. Nothing trains on data
from another version: the weights are those the rollouts sample from, until the step. The same
values as the forward over the whole batch (tested bit-exact on CPU).

Colocated runs stream the rollout side only (the learner is offloaded while the engines are awake);
one step off, the rollouts already overlap the learner's step.
"""
from __future__ import annotations

import queue
import time

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.driver import IterationAbandoned
from spice_megatron.loop.interfaces import RolloutBatch, RolloutDriver
from spice_megatron.policy.batching import TrainSequence
from spice_megatron.policy.parallel import broadcast_from_driver
from spice_megatron.rollout.fleet import NoEngineLeft


def overlaps(cfg: SpiceConfig) -> bool:
    """Whether an iteration runs the learner's old log-probs during its rollouts."""
    return cfg.old_logprobs_during_rollouts


def _next_chunk(chunks: queue.Queue) -> list[TrainSequence] | None:
    """What is complete: waits for one document's sequences, takes every one finished meanwhile;
    None once the rollouts have ended."""
    chunk = chunks.get()
    while chunk is not None:
        try:
            more = chunks.get_nowait()
        except queue.Empty:
            break
        if more is None:
            chunks.put(None)  # the end: after this chunk's forward
            break
        chunk = chunk + more
    return chunk


def rollouts_with_old_logprobs(driver: RolloutDriver | None, learner, deliver, control, iteration: int, version: int
                               ) -> tuple[RolloutBatch | None, str, bool, dict[tuple, list[float]], dict[str, float]]:
    """Every learner rank: the iteration's rollouts on the driver (rank 0), meanwhile the old
    log-probs of each chunk of complete documents (broadcast like the batch). Returns the batch (rank
    0), why no engine was left or whether a STOP abandoned it, the old log-probs by sequence, stats."""
    future, chunks = driver.start_streamed(iteration, version) if driver else (None, None)
    old: dict[tuple, list[float]] = {}
    seconds, forwards = 0.0, 0
    while True:
        chunk = _next_chunk(chunks) if driver else None
        if not broadcast_from_driver(chunk is not None, control):
            break
        seqs, _ = deliver(chunk, forward_only=True)  # every sequence runs: its routing goes where it runs
        t0 = time.perf_counter()
        old.update(zip((x.key() for x in seqs), learner.compute_logprobs(seqs)))
        seconds, forwards = seconds + time.perf_counter() - t0, forwards + 1
    batch, lost, abandoned = None, "", False
    if driver:
        try:
            batch = future.result()
        except NoEngineLeft as e:
            lost = str(e)
        except IterationAbandoned:
            abandoned = True
    stats = {"time/old_logprobs_during_rollouts": seconds,
             "train/old_logprobs_forwards_during_rollouts": float(forwards),
             "train/old_logprobs_precomputed": float(len(old))}
    return batch, lost, abandoned, old, stats
