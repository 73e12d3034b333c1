"""Running megatron-core 0.16.1 on a CPU-only torch build (tests, the CPU demo).

Everything here is applied only when CUDA is unavailable; on a GPU machine each entry point is a
no-op, so GPU behaviour never changes. What megatron-core needs on CPU (measured, see
shared/notes/megatron-core-on-cpu.md):
- RoPE moves its frequencies to `torch.cuda.current_device()` unconditionally;
- several buffers are allocated on `torch.cuda.current_device()`;
- the RNG tracker stores CUDA generator states;
- the pipeline schedules, the optimizers and clip_grads allocate with a literal `device="cuda"`
  and check `param.type() == "torch.cuda.FloatTensor"`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import random as mp_random
from torch.overrides import TorchFunctionMode

ON_CPU = not torch.cuda.is_available()
_applied = False


def apply() -> None:
    """Patch the process-wide call sites once (CPU only)."""
    global _applied
    if not ON_CPU or _applied:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        # megatron's version, minus the move of inv_freq to the current CUDA device
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    _applied = True


def _cpu_device(d):
    if isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cpu")
    return d


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites literal CUDA devices to CPU inside megatron calls, and reports CPU float tensors
    with their CUDA type names for megatron's optimizer type checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return "torch.cuda." + name[len("torch."):] if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], *[_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args[1:]])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Scope for megatron calls with literal CUDA devices; a no-op on GPU."""
    if not ON_CPU:
        yield
        return
    with CudaToCpuMode():
        yield


class CPURNGStatesTracker(mp_random.CudaRNGStatesTracker):
    """megatron's RNG tracker interface over CPU generator states."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def model_parallel_seed(seed: int) -> None:
    """megatron's model_parallel_cuda_manual_seed, with CPU generator states on CPU."""
    if not ON_CPU:
        mp_random.model_parallel_cuda_manual_seed(seed)
        return
    torch.manual_seed(seed)
    tracker = CPURNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank())
