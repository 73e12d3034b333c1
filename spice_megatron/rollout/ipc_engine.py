"""The engines' side of rollout.weight_transfer=ipc: vLLM's own CUDA IPC engine
(vllm/distributed/weight_transfer/ipc_engine.py), each tensor checked as it loads.

The trainer's client adds the learner's checksum of every tensor to each update (`checksums`, in
`names` order: FleetSyncClient, from EveryRankSource), and the tensors vLLM rebuilds from the IPC
handles are checksummed before `load_weights` takes them, as the spice backend checks its buckets.
A tied model also gets lm_head.weight with the embedding, as the spice backend gives it (vLLM's
layerwise reload unties them). Registered with vLLM's factory as `spice_ipc` (rollout/engine_transfer.py);
VLLMEngine runs it for `ipc`. The rebuild needs a GPU; `checked_load` is tested on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo


@dataclass
class CheckedIPCUpdateInfo(IPCWeightTransferUpdateInfo):
    checksums: list[int] | None = None  # the learner's, one per name


class CheckedIPCWeightTransferEngine(IPCWeightTransferEngine):
    update_info_cls = CheckedIPCUpdateInfo

    def receive_weights(self, update_info: CheckedIPCUpdateInfo) -> None:
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        checked_load(self.model, lambda: super(CheckedIPCWeightTransferEngine, self).receive_weights(update_info),
                     update_info.names, update_info.checksums, tied)


def checked_load(model, receive: Callable[[], None], names: list[str], checksums: list[int] | None,
                 tied: bool) -> int:
    """Run `receive()` (which ends in model.load_weights) with every tensor it loads checksummed and,
    given `checksums`, compared with the sender's (WeightSyncError naming the first that differs or
    is missing). Returns the number of tensors loaded."""
    from spice_megatron.bridge.sync_integrity import ReceivedManifest, compare_checksums, tensor_checksum

    got: dict[str, int] = {}
    load = model.load_weights

    def load_checked(weights):
        weights = list(weights)
        got.update({name: tensor_checksum(t) for name, t in weights})
        if tied:
            weights += [("lm_head.weight", t) for n, t in weights if n == "model.embed_tokens.weight"]
        return load(weights)

    model.load_weights = load_checked
    try:
        receive()
    finally:
        del model.load_weights  # the class's method again
    if checksums is not None:
        compare_checksums(got, ReceivedManifest(checksums=dict(zip(names, checksums))))
    return len(got)
