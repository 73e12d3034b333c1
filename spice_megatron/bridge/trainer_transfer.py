"""The learner's side of vLLM's weight-transfer interface, without importing vLLM.

The learner's image has no vLLM (it pins its own torch; tools/env/containers/learner.Dockerfile), so
this module implements vLLM 0.32's trainer-side interfaces structurally: `MegatronStageSource`
is a `WeightSource` (metadata, iteration, held names), `SpiceTrainerTransfer` a
`TrainerWeightTransferEngine` for our `spice` backend (`trainer_init`, `send_weights`), and the
control plane it drives is any `VLLMWeightSyncClient` (the fleet's HTTP client). Where vLLM is
importable they are registered with its factories (rollout/engine_transfer.py).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Collection, Iterator

import torch
import torch.distributed as dist

SPICE_BACKEND = "spice"


@dataclass(frozen=True)
class ParamMeta:
    """vLLM's ParamMeta, field for field: name, wire dtype, full (HF) shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class MegatronStageSource:
    """vLLM's `WeightSource` over a Megatron learner: HF-named, TP-gathered tensors, one pipeline
    stage per sending rank.

    metadata(): the whole model on every rank, in send order (stage by stage), built once with
    one all-gather over `group` at construction (a collective: every learner rank constructs it).
    Iteration: this stage's tensors on the stage's TP rank 0 of data-parallel rank 0 (the other
    TP ranks of DP rank 0 take part in the gather and yield nothing; other DP ranks yield
    nothing). The spice backend does not iterate: it gathers straight into its bucket slots
    (bridge/weight_sync.send_learner_weights), so a gathered tensor is never copied again.
    """

    def __init__(self, learner, group=None):
        from spice_megatron.bridge.export import stage_hf_outputs
        from spice_megatron.bridge.weight_sync import DTYPES

        self.learner = learner
        lay = learner.layout
        self.is_stage_sender = lay.tp_rank == 0 and lay.first_replica
        mine: list[tuple[str, str, tuple[int, ...]]] = []
        if self.is_stage_sender:
            mine = [(hf, str(param.dtype), shape) for _, param, outputs in stage_hf_outputs(learner)
                    for hf, shape in outputs]
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (lay.pp_rank, dist.get_rank(), mine) if self.is_stage_sender else None,
                               group=group)
        stages = {p[0]: p[2] for p in parts if p is not None}
        self.stage_senders = {p[0]: p[1] for p in parts if p is not None}  # pipeline stage -> global rank
        self.stage_meta = {stage: [ParamMeta(n, DTYPES[d], tuple(s)) for n, d, s in stages[stage]]
                           for stage in sorted(stages)}
        self._meta = [m for stage in sorted(stages) for m in self.stage_meta[stage]]
        self._held = {n for n, _, _ in mine}

    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def held_names(self) -> Collection[str]:
        return set(self._held)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from spice_megatron.bridge.export import gather_stage_tensors, holds_unique_weights

        if holds_unique_weights(self.learner.layout, self.learner.spec):
            yield from gather_stage_tensors(self.learner)

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self._meta)


class EveryRankSource:
    """vLLM's `WeightSource` for its `ipc` backend (colocation): every learner rank yields every HF
    tensor of the model, whole, in metadata order. vLLM's IPC trainer engine iterates the source on
    every rank, shares each rank's copy as a CUDA IPC handle, all-gathers the handles over the
    default process group and merges them by index, so each engine worker finds the copy on its own
    GPU (by UUID) and loads it through vLLM's `load_weights`, which takes whole HF tensors and
    slices them for the engine's own TP. Hence: the same names in the same order on every rank.

    Stage by stage, the stage's ranks gather each parameter over TP / EP (gather_stage_params, in
    lockstep) and its sender broadcasts the result to every rank of the job; one parameter's
    tensors exist at a time (vLLM's packed mode copies them into its IPC buffer)."""

    def __init__(self, stages: MegatronStageSource, group=None, checksums: bool = True):
        self.stages, self.learner, self.group = stages, stages.learner, group
        # rank 0's checksum of each tensor it yields: the engines check what they load against them
        self.checksums: dict[str, int] | None = {} if checksums and dist.get_rank() == 0 else None

    def metadata(self) -> list[ParamMeta]:
        return self.stages.metadata()

    def held_names(self) -> Collection[str]:
        return {m.name for m in self.stages.metadata()}

    @property
    def nbytes(self) -> int:
        return self.stages.nbytes

    @property
    def largest_tensor_bytes(self) -> int:
        return max(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self.stages.metadata())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from spice_megatron.bridge.export import gather_stage_params
        from spice_megatron.bridge.sync_integrity import tensor_checksum

        device = next(self.learner.model.parameters()).device
        mine = self.learner.layout.pp_rank
        for stage, meta in self.stages.stage_meta.items():
            src = self.stages.stage_senders[stage]
            if stage == mine:
                tensors = ((hf, shape, full[k] if full is not None else None)
                           for _, outputs, full in gather_stage_params(self.learner)
                           for k, (hf, shape) in enumerate(outputs))
            else:
                tensors = ((m.name, m.shape, None) for m in meta)
            for m, (hf, shape, tensor) in zip(meta, tensors, strict=True):
                if hf != m.name:
                    raise RuntimeError(f"stage {stage} gathers {hf} where its metadata has {m.name}")
                if tensor is None:
                    tensor = torch.empty(shape, dtype=m.dtype, device=device)
                dist.broadcast(tensor, src, group=self.group)
                if self.checksums is not None:
                    self.checksums[hf] = tensor_checksum(tensor)
                yield hf, tensor


@dataclass
class SpiceTrainerInitInfo:
    """vLLM's TrainerInitInfo for the spice backend (`backend` ClassVar, keyword-only `rank`):
    where the stage senders and the engines' workers meet."""

    backend: ClassVar[str] = SPICE_BACKEND

    host: str
    port: int
    num_stages: int
    num_receivers: int
    transport: str = "auto"  # gloo | nccl | auto
    timeout_s: float = 600.0
    bucket_bytes: int = 512 * 2**20
    rank: int = field(kw_only=True, default=0)

    @property
    def is_sender(self) -> bool:  # drives the engines' control plane (the driver, global rank 0)
        return self.rank == 0


class SpiceTrainerTransfer:
    """Trainer side of the spice backend. Every learner rank calls `trainer_init` and
    `send_weights`; rank 0 drives the engines through the client, the stage senders stream
    their stage's buckets (bridge/weight_sync.py), the other TP ranks feed the gather."""

    def __init__(self, info: SpiceTrainerInitInfo, client, source: MegatronStageSource):
        self.info, self.client, self.source = info, client, source
        self.is_sender = info.is_sender
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: SpiceTrainerInitInfo, *, client=None, source: MegatronStageSource | None = None):
        from spice_megatron.bridge.weight_sync import WeightSyncGroup

        if source is None:
            raise ValueError("the spice weight transfer needs a MegatronStageSource")
        engine = cls(init_info, client, source)
        worker_info = {"host": init_info.host, "port": init_info.port, "rank_offset": init_info.num_stages,
                       "num_stages": init_info.num_stages, "num_receivers": init_info.num_receivers,
                       "transport": init_info.transport, "timeout_s": init_info.timeout_s}
        # the engines block in init until every member of the group has joined: ask them first
        with ThreadPoolExecutor(max_workers=1) as exe:
            joining = exe.submit(client.init_weight_transfer_engine, worker_info) if engine.is_sender else None
            try:
                if source.is_stage_sender:
                    engine.group = WeightSyncGroup(init_info.host, init_info.port, source.learner.layout.pp_rank,
                                                   init_info.num_stages, init_info.num_receivers,
                                                   init_info.transport, init_info.timeout_s)
            finally:
                if joining is not None:
                    joining.result()
        return engine

    def send_weights(self, version: int, nonce: str = "", key: bytes | None = None) -> dict[str, Any]:
        """One update, start to finish. `nonce` (rank 0: sent to the engines over the signed HTTP
        plane) and `key` (every stage sender: signs the buckets) are this sync's (the fleet client's
        `sync_credentials`). Returns this rank's figures (bytes sent by its stage)."""
        from spice_megatron.bridge.weight_sync import send_learner_weights

        receiving = None
        exe = ThreadPoolExecutor(max_workers=1) if self.is_sender else None
        try:
            if self.is_sender:
                self.client.start_weight_update()
                # the engines receive inside update_weights: it runs while the stages send
                receiving = exe.submit(self.client.update_weights, {"version": version, "nonce": nonce,
                                                                    "max_bucket_bytes": self._largest_bucket()})
            report = send_learner_weights(self.source.learner, self.group, version, self.info.bucket_bytes, key)
            if receiving is not None:
                receiving.result()
                self.client.finish_weight_update(str(version))
        except BaseException:
            self.close_group()  # unblocks the engines still waiting for buckets
            if receiving is not None:  # every engine's answer first, so that none is left mid-request
                try:
                    receiving.result(timeout=self.info.timeout_s)
                except Exception:  # noqa: BLE001 - the send's own error is the one to report
                    pass
            raise
        finally:
            if exe is not None:
                exe.shutdown(wait=False)  # a receive stuck on a dead peer must not hang the learner
        return {"bytes": report.bytes if report else 0, "seconds": report.seconds if report else 0.0}

    def _largest_bucket(self) -> int:
        """What a sender's bucket can hold at most: half a bucket, or one parameter's HF tensors
        (a fused q/k/v or gate/up: three of the largest) in fp32, whichever is larger."""
        import math

        from spice_megatron.bridge.mapping import expected_hf_shapes

        largest = max(math.prod(shape) for shape in expected_hf_shapes(self.source.learner.spec).values())
        return max(self.info.bucket_bytes, 3 * 4 * largest) + 2**20

    def close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def shutdown(self) -> None:
        self.close_group()
