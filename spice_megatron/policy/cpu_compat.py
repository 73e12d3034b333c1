"""Running megatron-core 0.16.1 on a CPU-only torch build (tests, the CPU demo).

Everything here is applied only when CUDA is unavailable; on a GPU machine each entry point is a
no-op, so GPU behaviour never changes, except one fix that a GPU without Transformer Engine needs
as well (`_without_transformer_engine`). What megatron-core needs on CPU (measured; the
policy tests exercise each):
- RoPE moves its frequencies to `torch.cuda.current_device()` unconditionally;
- several buffers are allocated on `torch.cuda.current_device()`;
- the RNG tracker stores CUDA generator states;
- the pipeline schedules, the optimizers and clip_grads allocate with a literal `device="cuda"`
  and check `param.type() == "torch.cuda.FloatTensor"`.
Mixture-of-experts layers, in addition (measured with a 2-layer Qwen3-MoE at EP=1 and 2 on gloo):
- megatron requires sequence parallelism for MoE with TP > 1 in training, and its torch norms
  (no TE, no apex) refuse sequence parallelism; a norm is per token, so the only thing SP asks of
  it is TE's: mark its weight `sequence_parallel` so that finalize_model_grads sums its gradient
  over the TP ranks, each of which saw part of the sequence.
- recompute (megatron's CheckpointFunction) saves and restores the CUDA generator's state around
  the recomputed forward; on CPU the CPU generator, which it saves too, is the only one. The
  recomputed forward runs inside autograd's backward, where the torch-function mode that moves
  literal CUDA devices to CPU is not active: the causal mask is built on CPU directly;
- context parallelism: the rotary embedding picks its CP rank's chunks through a pinned index
  tensor, which a CPU-only build cannot allocate;
- the all-to-all dispatcher makes a `torch.cuda.Stream` for its device-to-host copies of the split
  sizes, waits on `torch.cuda.current_stream()`, and hands all_to_all_single the sizes as numpy
  arrays only after a CUDA -> host copy (on CPU they stay tensors, which gloo's binding refuses).
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
    _without_transformer_engine()
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
    _apply_context_parallel_rope()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    _apply_moe()
    _apply_sequence_parallel_norms()
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    _applied = True


def _apply_context_parallel_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
        # megatron's, with an unpinned index: chunks cp_rank and 2 CP - 1 - cp_rank
        cp, rank = cp_group.size(), cp_group.rank()
        chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
        mine = chunks.index_select(seq_dim, torch.tensor([rank, 2 * cp - rank - 1]))
        return mine.view(*mine.shape[:seq_dim], -1, *mine.shape[seq_dim + 2:])

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = on_this_cp_rank


def _apply_sequence_parallel_norms() -> None:
    import copy

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


class _HostEvent:
    def synchronize(self) -> None:
        pass


class _HostStream:
    """Stands in for the dispatcher's CUDA side stream: on CPU every copy is already done."""

    def wait_stream(self, _other) -> None:
        pass

    def record_event(self) -> _HostEvent:
        return _HostEvent()


def _apply_moe() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    host = _HostStream()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = host
    torch.cuda.current_stream = lambda *a, **k: host

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _without_transformer_engine() -> None:
    """On any device: megatron's moe_utils names `te_general_gemm` only when Transformer Engine
    imports, and its router calls it when it is not None: a NameError on a GPU without TE too
    (measured on an H200, gpu_check's MoE rows). With TE this changes nothing."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the router then takes its torch.mm branch
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):  # without TE its import yields a stand-in that isinstance refuses
        mla.HAVE_TE = False


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
