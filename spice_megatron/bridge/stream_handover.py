"""A received weight-sync bucket handed from the thread that received it to the one that loads it
(bridge/weight_receive.receive_all's concurrent receive on CUDA)."""
from __future__ import annotations

import torch


class StreamHandover:
    """A bucket received on one thread and consumed on another, on CUDA. NCCL's `work.wait()` only
    makes the *receiving thread's* current stream wait for the broadcast (PyTorch's current stream
    is per thread); vLLM's worker reads the bucket on its own non-blocking stream, with no implicit
    ordering against it. So the receiver records an event after the broadcast, the consumer's stream
    waits on it before any read, and `record_stream` tells the caching allocator that the consumer's
    stream uses the buffer, so that its block is not handed to the next bucket while the consumer's
    queued copies still read it. Off CUDA (gloo) the wait is blocking and there is nothing to do.
    `cuda` is torch.cuda; tests pass a stand-in that records the calls."""

    def __init__(self, device: torch.device, event=None, cuda=None):
        self.device, self.event, self.cuda = device, event, cuda

    @classmethod
    def mark(cls, device: torch.device, cuda=None) -> "StreamHandover":
        """Called by the receiving thread right after the broadcast of a bucket."""
        if device.type != "cuda":
            return cls(device)
        cuda = cuda or torch.cuda
        event = cuda.Event()
        event.record(cuda.current_stream(device))
        return cls(device, event, cuda)

    def to_current_stream(self, tensors: list[torch.Tensor]) -> None:
        """Called by the consuming thread before it reads `tensors` (views of the bucket)."""
        if self.event is None:
            return
        stream = self.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for t in tensors:
            t.record_stream(stream)
