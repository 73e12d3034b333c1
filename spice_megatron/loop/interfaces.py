"""What the training loop talks through: the batch an iteration's rollouts make (`RolloutBatch`),
and the two sides it calls as Protocols: the driver (`RolloutDriver`: rank 0's side of an
iteration, `driver.Driver` in the trainer's process or `driver_process.DriverProcess` in one of its
own) and the rollout engines (`EngineFleet`: `rollout/fleet.RolloutFleet`, the engines over HTTP).
The trainer, the rollout sources, the run guard, colocation and the weight updates are typed
against these, so either driver, or a test's stand-in, serves; tests/test_interfaces.py checks
that the implementations keep to them."""
from __future__ import annotations

import base64
import dataclasses
import queue
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from spice_megatron.policy.batching import TrainSequence
from spice_megatron.wire.types import Completion, SamplingSpec


@dataclass
class RolloutBatch:
    """One iteration's rollouts: what the learner trains on and what is logged for it. At
    staleness 1 a finished batch waits one iteration, so a checkpoint holds it (JSON)."""

    iteration: int
    version: int  # the engines' weights when its rollouts started
    stats: dict[str, float]
    records: list[dict]
    seqs: list[TrainSequence]

    def to_json(self) -> dict:
        seqs = []
        for x in self.seqs:
            d = dataclasses.asdict(x)
            if x.routed_experts is not None:  # [tokens, layers, k] in its own dtype: base64, not lists
                r = np.ascontiguousarray(x.routed_experts)
                d["routed_experts"] = {"shape": list(r.shape), "dtype": r.dtype.name,
                                       "data": base64.b64encode(r.tobytes()).decode("ascii")}
            seqs.append(d)
        # the other fields as they are: asdict(self) would deep-copy every sequence only to drop it
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "seqs"}, "seqs": seqs}

    @classmethod
    def from_json(cls, d: dict) -> "RolloutBatch":
        seqs = []
        for x in d["seqs"]:
            r = x.get("routed_experts")
            if r is not None:  # a checkpoint from before the dtype was kept has int16 under "int16"
                data, dtype = (r["data"], r["dtype"]) if "data" in r else (r["int16"], "int16")
                x = {**x, "routed_experts": np.frombuffer(base64.b64decode(data), np.dtype(dtype)).reshape(r["shape"])}
            seqs.append(TrainSequence(**x))
        return cls(d["iteration"], d["version"], d["stats"], d["records"], seqs)


class EngineFleet(Protocol):
    """The rollout engines as the loop uses them: generation, health, the version barrier, the
    weight sync's client and checksums, and sleep/wake for colocation."""

    def generate(self, prompts: list[str | list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """Completions for each prompt, the request cut over the healthy engines."""

    def health(self) -> dict[str, dict | None]:
        """Each engine's /status (None: it did not answer)."""

    def wait_until_healthy(self, timeout: float = 600.0) -> None:
        """Every engine healthy, or FleetError naming the ones that are not."""

    def barrier(self, version: int) -> None:
        """Every engine serves weights `version`."""

    @property
    def num_receivers(self) -> int:
        """The engine workers a weight sync sends to."""

    def sync_client(self):
        """vLLM's weight-sync client over the engines' HTTP control routes."""

    def weight_checksums(self) -> dict[str, str]:
        """The weights each engine serves, as checksums by tensor name, agreed between engines."""

    def sleep(self, level: int) -> dict[str, float]:
        """The engines asleep (colocation): seconds and memory freed."""

    def wake_up(self, tags: list[str] | None = None) -> dict[str, float]:
        """The engines awake (`tags`: weights, kv_cache, or all): seconds and memory taken."""

    def close(self) -> None:
        """The fleet's connections closed."""


class RolloutDriver(Protocol):
    """Rank 0's side of an iteration: the rollouts, the engines' upkeep, the logs and the kill switch."""

    fleet: EngineFleet  # rank 0's client of the engines (the weight sync's control plane, colocation)

    def selfplay(self, iteration: int, version: int) -> RolloutBatch:
        """Steps 1-4 of the iteration, start to end."""

    def start_selfplay(self, iteration: int, version: int) -> tuple[Future, dict]:
        """The same in the background (one step off); the dict is what a checkpoint needs to redo it."""

    def start_streamed(self, iteration: int, version: int) -> tuple[Future, queue.Queue]:
        """The same, with each complete document's trained sequences put on the queue as they come."""

    def restart_dead_engines(self) -> bool:
        """Engines the driver started that died, started again; True when any was."""

    def kill_engines(self, urls: list[str]) -> list[str]:
        """The engines at `urls` killed (a sync that failed on them); the ones it killed."""

    def recover_engines(self, why: str) -> str:
        """Engines lost during an iteration brought back, or EnginesLost; what it did, for the log."""

    def log(self, iteration: int, stats: dict[str, float], records: list[dict]) -> None:
        """The iteration's metrics row and audit records."""

    def check_kill_switch(self, stats: dict[str, float], loss: float, grad_norm: float) -> None:
        """KillSwitch when the run should stop itself."""

    def state(self) -> dict:
        """What a checkpoint keeps of the driver (the corpus cursor, the kill switch's counters)."""

    def close(self) -> None:
        """The fleet, the engines the driver started and the logs closed."""
