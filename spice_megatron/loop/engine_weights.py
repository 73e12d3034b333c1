"""The learner side of weight updates to the rollout engines (step 6 of an iteration): which backend
sends, the group it forms with the engines, and the retry after an engine dies during a sync."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from spice_megatron.config import SpiceConfig
from spice_megatron.loop.interfaces import RolloutDriver
from spice_megatron.policy.parallel import any_rank, broadcast_from_driver

log = logging.getLogger("spice.trainer")


def _sync_host(cfg: SpiceConfig) -> str:
    """The address the engines dial to join the weight-sync group (rank 0 hosts its store)."""
    import socket
    from urllib.parse import urlparse

    if cfg.rollout.sync_host:
        return cfg.rollout.sync_host
    loopback = ("127.0.0.1", "localhost", "::1", "")
    if all(urlparse(u).hostname in loopback for u in cfg.rollout.engines):
        return "127.0.0.1"
    master = os.environ.get("MASTER_ADDR", "")  # torchrun --standalone sets a loopback one
    return master if master not in loopback else socket.gethostbyname(socket.getfqdn())


class EngineWeightUpdater:
    """The learner side of the engines' weight updates, through vLLM's weight-transfer interface:
    a `WeightSource` over the learner (bridge/trainer_transfer.py), the trainer engine of the backend
    `rollout.weight_transfer`, and the fleet's HTTP client for vLLM's control plane (driver only)."""

    def __init__(self, cfg: SpiceConfig, learner, driver: RolloutDriver | None, control,
                 after_restart: Callable[[], None] = lambda: None):
        from spice_megatron.bridge.trainer_transfer import MegatronStageSource

        self.cfg, self.learner, self.driver, self.control = cfg, learner, driver, control
        # restarted engines start fully awake: colocated, they must hold their weights alone again
        # before the retry sends them (Colocation.before_sync), as after any other restart
        self.after_restart = after_restart
        self.source = MegatronStageSource(learner, control)
        self.host = broadcast_from_driver(_sync_host(cfg) if driver else "", control)
        self.transfer = None  # the trainer engine, until the group must be formed again
        self.client = None  # the fleet's control-plane client (driver only)
        self.bytes = 0.0

    def reform(self) -> None:
        """After an engine restart every member joins a fresh group on a new port."""
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None

    def sync(self, version: int) -> dict:
        """Stream the learner's weights to every engine. If an engine dies during the sync, the
        engines the trainer started are restarted, everyone joins a fresh group and the sync is
        tried once more; an engine that cannot be restarted (a cluster's) fails the run."""
        t0 = time.perf_counter()
        for attempt in (1, 2):
            error = self._attempt(version)
            if not any_rank(bool(error), self.control):
                return {"weight_sync/seconds": time.perf_counter() - t0, "weight_sync/bytes": self.bytes,
                        "weight_sync/retries": float(attempt - 1)}
            if attempt == 2:
                raise RuntimeError(f"weight sync of version {version} failed twice: {error or 'on another rank'}")
            if self.driver:
                log.warning("weight sync of version %d failed (%s); restarting dead engines and retrying",
                            version, error or "on another learner rank")
            broadcast_from_driver(self.driver.restart_dead_engines() if self.driver else None, self.control)
            self.reform()
            self.after_restart()
        raise AssertionError("unreachable")

    def _init_transfer(self):
        from spice_megatron.bridge.trainer_transfer import SpiceTrainerInitInfo, SpiceTrainerTransfer
        from spice_megatron.torchrun import free_port

        ro = self.cfg.rollout
        port = broadcast_from_driver((ro.sync_port or free_port()) if self.driver else 0, self.control)
        receivers = broadcast_from_driver(self.driver.fleet.num_receivers if self.driver else 0, self.control)
        self.client = self.driver.fleet.sync_client() if self.driver else None
        if ro.weight_transfer == "nccl":
            return _nccl_transfer(self.host, port, receivers, self.client, self.source)
        if ro.weight_transfer == "ipc":
            return _ipc_transfer(self.client, self.source, ro.bucket_mb * 2**20, self.control)
        info = SpiceTrainerInitInfo(self.host, port, self.learner.layout.pp, receivers, timeout_s=ro.sync_timeout,
                                    bucket_bytes=ro.bucket_mb * 2**20, rank=dist.get_rank())
        return SpiceTrainerTransfer.trainer_init(info, client=self.client, source=self.source)

    def _attempt(self, version: int) -> str:
        """One sync; returns this rank's error message ("" when it went through)."""
        try:
            if self.transfer is None:
                self.transfer = self._init_transfer()
            if self.cfg.rollout.weight_transfer == "spice":
                # every stage sender signs its buckets: the driver's fresh key goes to every rank
                nonce, key = broadcast_from_driver(self.client.sync_credentials() if self.driver else None,
                                                   self.control)
                sent = self.transfer.send_weights(version, nonce, key)["bytes"]
            else:  # vLLM's engine finishes without a version: the client stamps it
                if self.client:
                    self.client.version = str(version)
                self.transfer.send_weights()
                sent = self.source.nbytes if dist.get_rank() == 0 else 0
            # the driver reports one copy of the model: what every stage sent, together
            t = torch.tensor([float(sent)], dtype=torch.float64)
            dist.all_reduce(t, group=self.control)
            self.bytes = float(t.item())
            return ""
        except Exception as e:  # noqa: BLE001 - a dead peer surfaces as gloo/NCCL, HTTP or protocol errors
            if self.transfer is not None:
                self.transfer.shutdown()
            self.transfer = None
            return f"{type(e).__name__}: {e}"


def _ipc_transfer(client, source, buffer_bytes: int, control):
    """vLLM's built-in `ipc` trainer engine (distributed/weight_transfer/ipc_engine.py) for engines on
    the learner's own GPUs (run.colocate). What it requires of us, from its source:
    - a WeightSource iterated on every trainer rank with the same names in the same order: handles
      are all-gathered over the *default* process group and merged by index, and each engine worker
      opens the handle of its own GPU's UUID; so every rank yields every whole tensor
      (EveryRankSource), and the default group is exactly the learner's ranks (the driver process,
      if any, is not in it);
    - CUDA IPC handles are valid on the device that made them only: learner and engine share the GPU;
    - packed mode (one reused staging buffer per rank, `ipc_collect` after each chunk) refuses a
      tensor larger than its buffer: Qwen3's 151,936 x 4,096 bf16 embedding is 1.2 GB, over vLLM's
      1 GiB default, so the buffer is the larger of rollout.bucket_mb and the largest tensor;
    - no checksums of its own: rank 0's source checksums each tensor, the client adds them to every
      update and the engines (spice_ipc: vLLM's IPC engine, checked) compare as they load.
    Only rank 0 drives the engines' control plane, and a failed send ends on every rank together
    (bridge/ipc_sender.py). GPU only, and vLLM must be importable in the learner's environment (one
    image for both roles on a colocated node)."""
    from spice_megatron.bridge.trainer_transfer import EveryRankSource

    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        from spice_megatron.bridge.ipc_sender import AgreeingIPCTrainerEngine
    except ImportError as e:
        raise RuntimeError("rollout.weight_transfer=ipc: its trainer engine is vLLM's, and vLLM is not importable in "
                           "the learner's environment; a colocated node needs one image with both "
                           "(docs/cluster.md)") from e
    every = EveryRankSource(source)
    if client is not None:  # rank 0: each update carries the checksums of the tensors it shares
        client.checksums = every.checksums
    info = IPCTrainerInitInfo(rank=dist.get_rank(), packed=True,
                              packed_buffer_size_bytes=max(buffer_bytes, every.largest_tensor_bytes))
    return AgreeingIPCTrainerEngine.trainer_init(info, client=client, source=every, control=control)


def _nccl_transfer(host: str, port: int, receivers: int, client, source):
    """vLLM's built-in `nccl` trainer engine over the Megatron source (one sender: trainer rank 0,
    so pipeline parallelism 1; config.validate refuses the rest). GPU only, and vLLM must be
    importable on the learner; never run here (no GPU)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    except ImportError as e:
        raise RuntimeError("rollout.weight_transfer=nccl: its trainer engine is vLLM's, and vLLM is not importable "
                           "in the learner's environment (the learner image has none); use spice") from e
    info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=1 + receivers, rank=dist.get_rank())
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
