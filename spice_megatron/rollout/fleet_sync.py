"""The fleet as vLLM's weight-sync client: the trainer engine's control-plane calls (init / start /
update / finish / shutdown) on every engine of the fleet through its HTTP service, and each sync's
signing credentials."""
from __future__ import annotations

from spice_megatron.rollout.ipc_handles import encode_update
from spice_megatron.wire.auth import new_nonce, sync_key


class FleetSyncClient:
    """vLLM's `VLLMWeightSyncClient` (init / start / update / finish) over every engine of the fleet,
    through each engine's HTTP service; a call returns when every engine has answered. Each engine
    is a separate vLLM instance, so the client gives each its own `rank_offset`: the one it was
    given, plus the workers of the engines before it."""

    def __init__(self, fleet):
        """`fleet`: the RolloutFleet whose engines it updates."""
        self.fleet = fleet
        self.version: str | None = None  # stamped on an update whose trainer engine finishes without one
        # vLLM's ipc backend: the learner's checksum of each tensor it shares (EveryRankSource on rank
        # 0), added to every update for the engines to check (rollout/ipc_engine.py)
        self.checksums: dict[str, int] | None = None

    def sync_credentials(self) -> tuple[str, bytes]:
        """A fresh nonce for one weight sync (the engines get it with the update) and the key that
        signs its buckets, which the engines derive from the token and the nonce themselves."""
        nonce = new_nonce()
        return nonce, sync_key(self.fleet.token, nonce)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        bodies, offset = [], int(init_info.get("rank_offset", 0))
        for e in self.fleet.engines:
            bodies.append({"init_info": {**init_info, "rank_offset": offset}} if "rank_offset" in init_info
                          else {"init_info": init_info})
            offset += e.workers
        self.fleet.on_every_engine("/init_weight_transfer_engine", bodies)

    def start_weight_update(self) -> None:
        self.fleet.on_every_engine("/start_weight_update", [None] * len(self.fleet.engines))

    def update_weights(self, update_info: dict | list[dict]) -> None:
        if isinstance(update_info, dict):  # vLLM's ipc backend: CUDA IPC handles as JSON, not pickle
            if self.checksums is not None and "names" in update_info:
                update_info = {**update_info, "checksums": [self.checksums[n] for n in update_info["names"]]}
            update_info = encode_update(update_info)
        self.fleet.on_every_engine("/update_weights", [{"update_info": update_info}] * len(self.fleet.engines))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.fleet.on_every_engine("/finish_weight_update",
                                    [{"weight_version": weight_version or self.version}] * len(self.fleet.engines))

    def shutdown_weight_transfer_engine(self) -> None:
        self.fleet.on_every_engine("/shutdown_weight_transfer_engine", [None] * len(self.fleet.engines))
