"""The rollout section of a run's config (`rollout.*`): the engines, how they are reached and
started, the step they build and how weights reach them."""
from __future__ import annotations

from dataclasses import dataclass, field

from spice_megatron.entry import require as _require


@dataclass
class RolloutConfig:
    engines: list[str] = field(default_factory=list)  # attach to these URLs; empty: start local engines
    # the HF directory the engines serve ("": run.model); a bf16 copy where run.model is FP8 (spice convert bf16)
    model: str = ""
    challenger_engines: list[str] = field(default_factory=list)  # selfplay.challenger=model: the fixed challenger's
    local_engines: int = 1
    # engines started elsewhere (rollout.engines): the job's secret is $SPICE_ROLLOUT_TOKEN, or this file
    # (mode 600); engines this run starts get a fresh one. Never the secret itself: configs are saved.
    token_file: str = ""
    max_model_len: int = 4096
    kv_cache_gib: float = 1.0  # per local CPU engine
    # seconds one /generate request may take once posted: the fleet posts at most twice an engine's
    # max_num_seqs sequences at a time (rollout/fleet.py), so a request waits behind one queue at most
    request_timeout: float = 900.0
    health_timeout: float = 1800.0  # how long to wait for the engines to come up (large models load slowly)
    # sequences (prompts x n) per /generate request at most; a phase is cut into one near-equal unit
    # per healthy engine, or more of this size: the engine merges the requests that wait into one batch
    chunk_size: int = 64
    sync_host: str = ""  # where the stage senders meet the engines ("": loopback for local engines, else rank 0's host)
    sync_port: int = 0  # 0: pick a free port
    bucket_mb: int = 512
    # How long a weight-sync member waits for its peers in one step. It bounds how long the engines
    # wait for buckets from a sender that failed (an engine died mid-sync) before the sync is retried.
    sync_timeout: float = 300.0
    engine_tensor_parallel: int = 1  # GPUs per vLLM engine (cluster launchers start engines with it)
    # mixture-of-experts engines: vLLM's expert parallelism over the engine's GPUs (its MoE layers
    # split experts instead of slicing every expert over TP); GPU only
    engine_expert_parallel: bool = False
    challenger_engine_tensor_parallel: int = 0  # a local fixed challenger's engine (0: engine_tensor_parallel)
    gpu_memory_utilization: float = 0.85  # vLLM's share of each engine GPU (weights + KV cache)
    # the step every engine builds, the same on every node of an engine and pinned on every device (vLLM's
    # own defaults differ by device and entry point): tokens and sequences one step schedules; 0: 16384
    # and 1024 on a GPU, max(8192, max_model_len) and 256 per worker on the CPU (rollout/step_settings.py)
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    # vLLM weight-transfer backend the engines receive through (see WEIGHT_TRANSFER_REFUSED and docs/weight-sync.md):
    # spice: ours, every pipeline stage sends at once, gloo or NCCL; nccl: vLLM's, one sender (PP=1, GPU);
    # ipc: vLLM's CUDA IPC, for engines on the learner's own GPUs (run.colocate on a GPU)
    weight_transfer: str = "spice"
    # nccl (vLLM's own backend) signs no bucket and its store listens on every interface: only with this
    unsigned_sync: bool = False
    # run.colocate: how deep the engines sleep while the learner steps (vLLM's sleep mode). 1: weights
    # to host memory, KV cache dropped; 2: both dropped (the sync after every step refills the weights)
    sleep_level: int = 1

    def validate(self, prefix: str = "rollout") -> None:
        _require(self.weight_transfer not in WEIGHT_TRANSFER_REFUSED, f"{prefix}.weight_transfer",
                 WEIGHT_TRANSFER_REFUSED.get(self.weight_transfer, ""))
        _require(self.weight_transfer in ("spice", "nccl", "ipc"), f"{prefix}.weight_transfer",
                 f"unknown backend {self.weight_transfer!r} (spice, nccl, ipc)")
        _require(self.weight_transfer != "nccl" or self.unsigned_sync, f"{prefix}.weight_transfer",
                 "nccl is vLLM's backend: no bucket is signed and its store listens on every interface and unpickles "
                 "what it holds, so anyone who reaches it can run code in the engines and feed them weights; use "
                 f"spice, or set {prefix}.unsigned_sync=true on a network only the job reaches")
        _require(self.sleep_level in (1, 2), f"{prefix}.sleep_level", "must be 1 (weights to host) or 2 (discarded)")
        _require(bool(self.engines) or self.local_engines >= 1, f"{prefix}.local_engines",
                 "needs >= 1 when no rollout.engines are given")
        _require(self.bucket_mb > 0, f"{prefix}.bucket_mb", "must be > 0")
        _require(self.chunk_size >= 1, f"{prefix}.chunk_size", "must be >= 1 (sequences per request)")
        _require(self.sync_timeout > 0, f"{prefix}.sync_timeout", "must be > 0")
        _require(self.engine_tensor_parallel >= 1, f"{prefix}.engine_tensor_parallel", "must be >= 1")
        _require(self.challenger_engine_tensor_parallel >= 0, f"{prefix}.challenger_engine_tensor_parallel",
                 "must be >= 0 (0: engine_tensor_parallel)")
        _require(0 < self.gpu_memory_utilization <= 1, f"{prefix}.gpu_memory_utilization", "must be in (0, 1]")
        _require(self.max_num_batched_tokens >= 0, f"{prefix}.max_num_batched_tokens", "must be >= 0 (0: the device's)")
        _require(self.max_num_seqs >= 0, f"{prefix}.max_num_seqs", "must be >= 0 (0: the device's)")


# vLLM 0.32's other built-in backends, and why a Megatron learner behind this service cannot use them
WEIGHT_TRANSFER_REFUSED = {
    "nccl_m2n": "needs a resharding plan from the trainer's own layout (FSDP/DTensor); a Megatron TP x PP learner "
                "sends HF tensors already gathered: use spice",
    "sparse_nccl": "sends changed weights only, from a trainer that tracks them; full updates: use spice",
    "sharded_rdt": "needs Ray and a sharded trainer source; use spice",
}
