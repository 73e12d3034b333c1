"""The colocated ipc weight sync when an engine fails mid-send (spice_megatron/bridge/ipc_sender.py):
vLLM's packed IPC trainer engine, run on two gloo ranks with its chunk loop as it is (each chunk's
handle all-gather and barrier on the default group); only the CUDA buffer (packed_ipc_producer) is
a CPU stand-in. Rank 0 once raised at the failed chunk and rank 1 waited in the
next collective until the watchdog; every rank must leave the send together."""
from types import SimpleNamespace

import pytest
from dist_utils import run_ranks

pytestmark = pytest.mark.multiprocess


class _Source:
    """Four tensors, each broadcast from rank 0 as EveryRankSource does: a collective per tensor."""

    def __init__(self):
        self.yielded = 0

    def __iter__(self):
        import torch
        import torch.distributed as dist

        for i in range(4):
            t = torch.full((8,), float(i))
            dist.broadcast(t, 0)
            self.yielded += 1
            yield f"w{i}", t


class _Client:
    def __init__(self, fail_at: str, chunk: int = -1):
        self.fail_at, self.chunk, self.calls = fail_at, chunk, []

    def _call(self, name):
        self.calls.append(name)
        if name == self.fail_at and (name != "update_weights" or self.calls.count(name) == self.chunk):
            raise RuntimeError(f"engine refused {name}")

    def init_weight_transfer_engine(self, _info):
        self._call("init")

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, _update):
        self._call("update_weights")

    def finish_weight_update(self):
        self._call("finish")


def _rank(fail_at: str, chunk: int):
    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer import ipc_engine

    from spice_megatron.bridge.ipc_sender import AgreeingIPCTrainerEngine
    from spice_megatron.policy.parallel import any_rank

    dist.init_process_group("gloo")
    control = dist.new_group(backend="gloo")
    torch.cuda.synchronize = torch.cuda.ipc_collect = lambda *a, **k: None  # no CUDA here

    def producer(iterator, gpu_uuid, post_iter_func, buffer_size_bytes):  # one chunk per tensor, no buffer
        for name, t in iterator:
            yield SimpleNamespace(names=[name], dtype_names=["float32"], shapes=[list(t.shape)],
                                  ipc_handle={gpu_uuid: ("handle", dist.get_rank())}, tensor_sizes=[t.numel()])

    ipc_engine.packed_ipc_producer = producer
    rank = dist.get_rank()
    source, client = _Source(), _Client(fail_at, chunk)
    info = ipc_engine.IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=1024)
    engine = AgreeingIPCTrainerEngine.__new__(AgreeingIPCTrainerEngine)  # vLLM's __init__ asks CUDA for the GPU
    engine.client, engine.source, engine.is_sender = (client if rank == 0 else None), source, info.is_sender
    engine.packed, engine.packed_buffer_size_bytes, engine.gpu_uuid = True, 1024, "GPU-0"
    engine.control, engine.announced, engine.error = control, False, None
    try:
        engine.send_weights()
        error = ""
    except RuntimeError as e:
        error = str(e)
    agreed = any_rank(bool(error), control)  # EngineWeightUpdater's agreement: every rank reaches it
    return error, agreed, source.yielded, client.calls if rank == 0 else []


@pytest.mark.parametrize("fail_at, chunk", [("update_weights", 2), ("start", -1), ("", -1)])
def test_a_failed_send_ends_on_every_rank_together(tmp_path, fail_at, chunk):
    (e0, agreed0, yielded0, calls), (e1, agreed1, yielded1, _) = run_ranks(_rank, 2, fail_at, chunk,
                                                                            tmp_path=tmp_path, timeout=120)
    assert e1 == "" and agreed0 == agreed1 == bool(fail_at)
    if fail_at == "update_weights":  # rank 0 stops calling the engines, every rank runs every chunk's collectives
        assert e0 == "engine refused update_weights" and yielded0 == yielded1 == 4
        assert calls == ["init", "start", "update_weights", "update_weights"]
    elif fail_at == "start":  # refused before any chunk: no rank iterates the source
        assert e0 == "engine refused start" and yielded0 == yielded1 == 0
    else:
        assert e0 == "" and calls == ["init", "start", *["update_weights"] * 4, "finish"]
