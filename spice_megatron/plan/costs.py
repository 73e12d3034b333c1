"""The planner's time terms: a rollout phase on vLLM engines and a learner's iteration on Megatron,
shared by the SPICE iteration (`planner.estimate_step_time`) and the calibration against NeMo-RL's
published GRPO runs (`calibration.py`), so that the figures the calibration checks are the ones
the recipes are planned with."""
from __future__ import annotations

import math
from dataclasses import dataclass

from spice_megatron.config import GPU_PARTS
from spice_megatron.families import ModelSpec

GiB = 1024**3


@dataclass
class Throughput:
    """Assumptions behind the step time (H100 SXM numbers by default; `for_gpu` the cluster's part)."""

    peak_tflops: float = 989.0  # dense bf16
    train_mfu: float = 0.35  # Megatron-Core dense models at this size typically reach 35-45%
    # mixture-of-experts learners (dropless grouped GEMMs, a few thousand tokens per micro-batch over
    # many experts): calibrated against NeMo-RL's Qwen3-30B-A3B and Qwen3-235B runs (plan/calibration.py)
    moe_train_mfu: float = 0.15
    prefill_mfu: float = 0.5
    hbm_tb_s: float = 3.35
    decode_bandwidth_efficiency: float = 0.6  # share of HBM bandwidth a decode step achieves
    sync_gb_s: float = 20.0  # per pipeline stage sender, inter-node (NCCL over 400 Gb/s IB)
    all_to_all_gb_s: float = 100.0  # per GPU, expert all-to-all within an NVLink node
    # per GPU: a collective's bus bandwidth inside an NVLink node (TP/SP all-gathers and
    # reduce-scatters, the data-parallel gradient reduce) and over the node's InfiniBand (one
    # 400 Gb/s NIC per GPU); what crosses nodes goes at the second
    nvlink_gb_s: float = 300.0
    inter_node_gb_s: float = 40.0
    # a small all-reduce's latency (a decode step's two per layer under engine TP): NCCL inside a
    # node, and across nodes (an engine's TP wider than a node)
    nvlink_latency_us: float = 8.0
    inter_node_latency_us: float = 40.0
    # the self-play workload per document (paper settings B=128, G=8; lengths are assumptions)
    doc_tokens: int = 3000  # mean; segments are at most 5992
    # challenger rounds: each pending document gets selfplay.attempts_per_round attempts per round (the
    # paper protocol: a selection step, then a generation per valid selection, two sequential calls);
    # a round lasts at least its longest output, and documents without a valid task go again
    challenger_rounds: int = 3  # rounds until the slowest document has a task (early training: more)
    pending_after_round: float = 0.25  # share of a round's documents still without a valid task
    selection_gen_tokens: int = 150
    selection_valid_rate: float = 0.9
    challenger_gen_tokens: int = 600
    question_tokens: int = 200
    reasoner_gen_tokens: int = 1000  # mean; the tail runs to the reasoner's max tokens
    # colocation: vLLM's IPC weight sync inside a node (each rank's whole-model copy through its packed
    # buffer, then the engines' load), host <-> GPU copies (pinned) for sleep level 1 and the learner's
    # optimizer offload, and megatron's CPU Adam (optim.cpu_offload_fraction), parameters per second per GPU
    ipc_gb_s: float = 50.0
    host_gb_s: float = 20.0
    cpu_adam_params_per_s: float = 0.5e9
    # train.shared_prefix: distinct prompts among a document's G challenger trajectories (the compact
    # protocol: 1; the paper's generation prompt names the answer type, and an invalid selection's
    # trajectory has the selection prompt)
    paper_challenger_prompts: float = 3.0

    @classmethod
    def for_gpu(cls, gpu: str) -> "Throughput":
        """These assumptions with the part's dense bf16 FLOP/s and HBM bandwidth (config.GPU_PARTS)
        and its node's links (NETWORK)."""
        _, tflops, hbm = GPU_PARTS[gpu]
        nvlink, inter_node = NETWORK[gpu]
        return cls(peak_tflops=tflops, hbm_tb_s=hbm, nvlink_gb_s=nvlink, inter_node_gb_s=inter_node,
                   all_to_all_gb_s=nvlink / 3)


# Per GPU, the bus bandwidth (GB/s) a collective reaches inside an HGX node and across nodes. NVIDIA's
# datasheets: H100 and H200 SXM have NVLink 4 (900 GB/s per GPU, both directions), B200 NVLink 5 (1.8
# TB/s); HGX/DGX H100, H200 and B200 nodes have one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s). Taken at
# two thirds of NVLink's one-way rate and 80% of the NIC's, as NCCL's tests reach.
NETWORK: dict[str, tuple[float, float]] = {
    "h100": (300.0, 40.0),
    "h200": (300.0, 40.0),
    "b200": (600.0, 40.0),
}


def decode_phase(spec: ModelSpec, engine_tp: int, engines: int, max_sequences: int, kv_bytes_per_token: int,
                 max_model_len: int, sequences: float, prompt_tokens: float, gen_tokens: float, max_gen: float,
                 t: Throughput, gpus_per_node: int = 8) -> tuple[float, float, float]:
    """One rollout phase over `engines` engines: (its seconds when it waits for its longest output,
    the engines' busy seconds for these sequences alone, one decode step at its concurrency).
    Decode is bandwidth-bound: a step reads the engine's weights (every expert: a batch of hundreds
    of tokens touches them all) and the live KV cache once, and under engine TP waits for two
    all-reduces per layer; prefill FLOPs follow the active parameters."""
    per_engine = sequences / engines
    concurrency = max(1.0, min(per_engine, max_sequences * max_model_len / (prompt_tokens + gen_tokens)))
    kv_read = concurrency * (prompt_tokens + gen_tokens / 2) * kv_bytes_per_token
    step = (2 * spec.num_parameters / engine_tp + kv_read) / (t.hbm_tb_s * 1e12 * t.decode_bandwidth_efficiency)
    if engine_tp > 1:
        latency = t.nvlink_latency_us if engine_tp <= gpus_per_node else t.inter_node_latency_us
        step += 2 * spec.num_layers * latency * 1e-6
    waves = math.ceil(per_engine / concurrency)
    prefill = 2 * spec.active_parameters * per_engine * prompt_tokens / (
        engine_tp * t.peak_tflops * 1e12 * t.prefill_mfu)
    return (max(waves * gen_tokens, max_gen) * step + prefill,
            per_engine / concurrency * gen_tokens * step + prefill, step)


@dataclass(frozen=True)
class LearnerWork:
    """What the learner runs in one iteration."""

    tokens: float  # through every pass below
    mean_row_tokens: float  # a row's length: the context the attention of its tokens reads (causal: half)
    forwards: int  # forward-only passes before the update (old log-probs, a reference model's)
    recomputed_params: float  # parameters run again in the backward (activation recompute), per token
    full_recompute: bool  # every layer again: its TP collectives too
    micro_batches: float  # per pipeline per optimizer step (the 1F1B bubble is (PP-1) of them)
    steps: int  # optimizer steps
    moe_recompute: bool = False  # train.recompute_modules "moe": the experts' dispatch and combine run again


def _forward_flops_per_token(spec: ModelSpec, work: LearnerWork) -> float:
    """The active parameters' matmuls, and QK^T and AV (2 x 2 FLOPs per query, key and channel;
    causal: half the row on average)."""
    attention = 4 * (work.mean_row_tokens / 2) * spec.num_heads * spec.head_dim * spec.num_layers
    return 2 * spec.active_parameters + attention


def _mfu(spec: ModelSpec, t: Throughput) -> float:
    return t.moe_train_mfu if spec.moe is not None else t.train_mfu


def forward_pass_seconds(spec: ModelSpec, work: LearnerWork, gpus: int, t: Throughput) -> float:
    """One forward-only pass over the work's tokens (the old log-probs' share of `compute`)."""
    return work.tokens * _forward_flops_per_token(spec, work) / (gpus * t.peak_tflops * 1e12 * _mfu(spec, t))


def learner_seconds(spec: ModelSpec, work: LearnerWork, weights_gib: float, gpus: int, tp: int, pp: int, dp: int,
                    gpus_per_node: int, t: Throughput, vpp: int = 1, cp: int = 1) -> dict[str, float]:
    """Seconds of the learner's iteration, term by term: matmul and attention FLOPs at the part's
    peak x train_mfu (moe_train_mfu for a mixture-of-experts model); the pipeline bubble
    ((PP-1)/(VPP x micro-batches) of them); the TP/SP and CP collectives of every pass (4 of a
    token's hidden state per layer: two all-gathers and two reduce-scatters under sequence
    parallelism, or two all-reduces), not overlapped; and per optimizer step the data-parallel
    all-gather of the updated bf16 weights (`weights_gib` per GPU; the gradients' reduce-scatter
    overlaps the backward). A collective inside a node goes at NVLink's bandwidth, one that spans
    nodes at InfiniBand's."""
    passes = work.forwards + 3  # forward-only passes + forward and backward (2x)
    forward = _forward_flops_per_token(spec, work)
    per_token = forward * passes + 2 * work.recomputed_params
    if work.full_recompute:
        per_token += forward - 2 * spec.active_parameters  # the attention's share: the params' is in recomputed_params
    compute = work.tokens * per_token / (gpus * t.peak_tflops * 1e12 * _mfu(spec, t))
    bubble = compute * (pp - 1) / (vpp * max(work.micro_batches, 1.0)) if pp > 1 else 0.0

    def bandwidth(group: int) -> float:
        return (t.nvlink_gb_s if group <= gpus_per_node else t.inter_node_gb_s) * 1e9

    tensor_passes = work.forwards + 2 + (1 if work.full_recompute else 0)
    layers = spec.num_layers / pp
    per_replica = work.tokens / dp / cp  # tokens one TP group's GPUs run
    tp_comm = 0.0
    if tp > 1:
        tp_comm = per_replica * layers * tensor_passes * 4 * 2 * spec.hidden_size * (tp - 1) / tp / bandwidth(tp)
    cp_comm = 0.0
    if cp > 1:  # each rank's K and V go round the ring, forward and backward
        kv = 2 * spec.num_kv_heads * spec.head_dim * 2 / tp
        cp_comm = per_replica * layers * tensor_passes * kv * (cp - 1) / bandwidth(tp * cp)
    dp_comm = 0.0
    if dp > 1:
        dp_comm = work.steps * weights_gib * GiB * (dp - 1) / dp / bandwidth(gpus)
    return {"compute": compute, "bubble": bubble, "tp_comm": tp_comm, "cp_comm": cp_comm, "dp_comm": dp_comm}


def all_to_all_seconds(micro_batches: float, per_micro_batch_gib: float, work: LearnerWork, inside_node: bool,
                       t: Throughput) -> float:
    """The experts' all-to-all, not overlapped with compute: `per_micro_batch_gib` is one micro-batch's
    forward and backward (3 of a forward's); each forward-only pass and a recompute of the MoE layers
    (full, or selective "moe") add one more. `inside_node`: megatron puts an EP group on consecutive
    ranks (its expert grid's order tp-cp-ep-dp-pp, with ETP innermost), so EP x ETP <= a node's GPUs
    stays on NVLink whatever TP is."""
    passes = (3 + work.forwards + (1 if work.full_recompute or work.moe_recompute else 0)) / 3
    bandwidth = t.all_to_all_gb_s if inside_node else t.inter_node_gb_s
    return micro_batches * per_micro_batch_gib * passes * GiB / (bandwidth * 1e9)
