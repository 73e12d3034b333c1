"""vLLM's packed CUDA-IPC trainer engine (rollout.weight_transfer=ipc, colocated), changed in one
respect: every learner rank leaves a failed send together.

vLLM's engine runs collectives on every rank for each chunk (the handles' all-gather and a barrier
on the default group) while rank 0 alone talks to the engines over HTTP. An engine's error raises
on rank 0 at once, and every other rank then waits in that chunk's collective until the NCCL
watchdog ends the job (30 minutes), so EngineWeightUpdater's restart-and-retry never runs. Here rank 0
records the first error, makes no further HTTP call and keeps joining every collective to the end
of the source; the engines' acceptance of the update (init, start) is agreed on the learner's
control group before any chunk; then rank 0 raises and every rank reaches EngineWeightUpdater's agreement.
Imported only where vLLM is (the ipc backend's learner image)."""
from __future__ import annotations

from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

from spice_megatron.policy.parallel import any_rank


class AgreeingIPCTrainerEngine(IPCTrainerWeightTransferEngine):

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None, control=None) -> "AgreeingIPCTrainerEngine":
        """vLLM's trainer_init without its HTTP call, which send_weights makes where every rank
        agrees on its outcome."""
        if source is None:
            raise ValueError("IPC trainer weight transfer requires a WeightSource.")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes)
        engine.control = control
        engine.announced = False
        engine.error = None
        return engine

    def send_weights(self) -> None:
        self.error = None
        if self.is_sender:
            self._guarded(self._start)
        if any_rank(self.error is not None, self.control):  # the engines refused: no rank sends a chunk
            self._raise_on_sender()
            return
        weight_refs = self._send(self.source)
        if self.is_sender and self.error is None:
            self._guarded(self.client.finish_weight_update)
        self._post_send_sync()
        del weight_refs
        self._raise_on_sender()

    def _start(self) -> None:
        if not self.announced:  # the worker decodes exactly as this trainer encodes
            self.client.init_weight_transfer_engine({"packed": self.packed})
            self.announced = True
        self.client.start_weight_update()

    def _do_send(self, *args, **kwargs) -> None:
        if self.error is None:  # after an error: no HTTP call, but the caller's collectives still run
            self._guarded(lambda: super(AgreeingIPCTrainerEngine, self)._do_send(*args, **kwargs))

    def _guarded(self, call) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - any engine error ends the send on every rank alike
            self.error = e

    def _raise_on_sender(self) -> None:
        if self.is_sender and self.error is not None:
            raise self.error
