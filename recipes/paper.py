"""The paper's recipes (SPICE.md: B=128, G=8, N=1024, temperature 1.0, rho=-0.1, T=640, documents
of at most 5,992 tokens) on its four base models, and the same algorithm on larger models with
tensor + pipeline parallelism. Layouts are for nodes of 8 x H100 80 GB; `spice plan --recipe NAME`
checks them (and proposes others) for a different cluster."""
from __future__ import annotations

import os

from recipes.registry import BASELINE, COLOCATED, FAMILY, LARGE, MOE, PAPER, recipe
from spice_megatron.config import (
    GPU_PARTS,
    ClusterConfig,
    CorpusConfig,
    OptimConfig,
    ParallelConfig,
    PolicyTrainConfig,
    RolloutConfig,
    RunConfig,
    SelfPlayConfig,
    SourceConfig,
    SpiceConfig,
)

# The paper's corpus (SPICE.md, corrected): raw documents, 50% Nemotron-CC-Math and 50% general
# documents from DCLM, a 20,000-document pool. Streamed from the hub by `spice prepare --recipe NAME`
# into corpus.stage_dir (first max_records records of each), then read offline by the job.
MATH_SOURCE = SourceConfig(path="nvidia/Nemotron-CC-Math-v1", name="nemotron_cc_math", hub_config="4plus",
                           streaming=True, max_records=100_000, weight=1.0)
GENERAL_SOURCES = {
    "dclm": SourceConfig(path="mlfoundations/dclm-baseline-1.0", name="dclm", text_field="text", streaming=True,
                         max_records=100_000, weight=1.0),
    # An explicitly named alternative, NOT the paper's corpus: NaturalReasoning publishes questions
    # back-translated from DCLM documents, not the documents.
    "natural_reasoning": SourceConfig(path="facebook/natural_reasoning", name="natural_reasoning",
                                      text_field="question", streaming=True, max_records=100_000, weight=1.0),
}


def paper_sources(general: str = "dclm") -> list[SourceConfig]:
    if general not in GENERAL_SOURCES:
        raise KeyError(f"general corpus {general!r} is unknown; choose from {', '.join(GENERAL_SOURCES)}")
    return [SourceConfig(**vars(MATH_SOURCE)), SourceConfig(**vars(GENERAL_SOURCES[general]))]


def stage_dir(name: str) -> str:
    """Where `spice prepare --recipe NAME` stages the hub corpus: $SPICE_DATA_DIR/staged/NAME."""
    return os.path.join(os.environ.get("SPICE_DATA_DIR", "data"), "staged", name)


def with_general_corpus(cfg: SpiceConfig, general: str) -> SpiceConfig:
    """A paper recipe with another general half (`--general-corpus`); its own stage directory."""
    cfg.corpus.sources = paper_sources(general)
    if general != "dclm":
        cfg.corpus.stage_dir = cfg.corpus.stage_dir.rstrip("/") + f"_{general}"
    return cfg


# The longest challenger request: the paper's published generation prompt (about 2,200 tokens for the
# free-form one, loaded through selfplay.prompt_dir; the built-in prompts are ~350), a document of up to
# 5,992 tokens and 2,048 output tokens: ~10,300. 8,192 held the built-in prompts only with documents
# under ~5,800 tokens, and a published prompt not at all (docs/fidelity.md). Start-up refuses a
# context that cannot hold the worst case (context_budget.py). Every paper base model serves 32k+.
MAX_MODEL_LEN = 12288


def paper_config(name: str, model: str, *, nodes: int, learner_nodes: int, tp: int, pp: int, engine_tp: int,
                 template: str, micro_batch_tokens: int = 8192, gpu: str = "h100", ep: int = 1) -> SpiceConfig:
    """Algorithm 1 as published: the selection + JSON protocol, challenger groups of G=8 per document
    (invalid attempts trained, advantages centred per document), the family's prompt template, and
    updates of 128 trajectories (an iteration's ~2,048 in ~16 optimiser steps, PPO clip after the first)."""
    return SpiceConfig(
        run=RunConfig(name=name, model=model, output_dir=f"runs/{name}", iterations=640, checkpoint_every=10,
                      keep_last=3, eval_every=0, min_valid_task_rate=0.02, patience=20,
                      driver="process"),  # rank 0's step does not share its interpreter with the rollouts
        corpus=CorpusConfig(sources=paper_sources(), max_doc_tokens=5992, max_docs=20000, stage_dir=stage_dir(name)),
        selfplay=SelfPlayConfig(batch_docs=128, group_size=8, max_attempts=1024, attempts_per_round=8,
                                challenger_temperature=1.0, reasoner_temperature=1.0, invalid_penalty=-0.1,
                                challenger_max_tokens=2048, reasoner_max_tokens=4096, selection_max_tokens=512,
                                protocol="paper", challenger_group="document", template=template),
        parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep),
        # Where the paper is silent its runs took Oat's defaults (sail-sg/oat, oat/args.py and
        # oat/algorithms/ppo.py): Adam betas (0.9, 0.95), no weight decay, grad-norm clip 1.0; truncated
        # importance sampling against the vLLM sampler's log-probs, capped at 2.0, on every update. Oat's
        # warm-up ratio 0.03 does not apply: transformers' "constant" schedule, the paper's, has none.
        optim=OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95, warmup_steps=0,
                          decay_style="constant", use_distributed_optimizer=True),
        train=PolicyTrainConfig(max_gen_len=4096, micro_batch_tokens=micro_batch_tokens, dtype="bf16",
                                trajectories_per_update=128, importance_sampling="on", tis_cap=2.0),
        rollout=RolloutConfig(max_model_len=MAX_MODEL_LEN, engine_tensor_parallel=engine_tp, request_timeout=3600.0,
                              chunk_size=256, bucket_mb=1024),
        cluster=ClusterConfig(nodes=nodes, gpus_per_node=8, gpu_memory_gib=GPU_PARTS[gpu][0],
                              learner_nodes=learner_nodes,
                              gpu=gpu),
    )


@recipe(PAPER)
def qwen3_4b() -> SpiceConfig:
    cfg = paper_config("qwen3_4b", "Qwen/Qwen3-4B-Base", nodes=2, learner_nodes=1, tp=1, pp=1, engine_tp=1,
                       template="qwen3")
    # TP=1 keeps every activation on one GPU: 94% of 80 GiB planned without recompute, 71% with the
    # MLPs recomputed in the backward (about a fifth more compute; policy/activation_memory.py)
    cfg.train.recompute = "selective"
    return cfg


@recipe(PAPER)
def qwen3_8b() -> SpiceConfig:
    return paper_config("qwen3_8b", "Qwen/Qwen3-8B-Base", nodes=2, learner_nodes=1, tp=2, pp=1, engine_tp=1,
                        template="qwen3")


@recipe(PAPER)
def octothinker_3b() -> SpiceConfig:
    return paper_config("octothinker_3b", "OctoThinker/OctoThinker-3B-Hybrid-Base", nodes=2, learner_nodes=1,
                        tp=1, pp=1, engine_tp=1, template="octothinker")


@recipe(PAPER)
def octothinker_8b() -> SpiceConfig:
    return paper_config("octothinker_8b", "OctoThinker/OctoThinker-8B-Hybrid-Base", nodes=2, learner_nodes=1,
                        tp=2, pp=1, engine_tp=1, template="octothinker")


@recipe(LARGE)
def qwen3_14b() -> SpiceConfig:
    return paper_config("qwen3_14b", "Qwen/Qwen3-14B-Base", nodes=4, learner_nodes=2, tp=4, pp=1, engine_tp=2,
                        template="qwen3")


@recipe(LARGE)
def qwen3_32b() -> SpiceConfig:
    """Colocated on 4 nodes (NeMo-RL's GPU count for Qwen3-32B): TP=8 PP=1 DP=4 learner, 8 engines x
    TP=4 on the same GPUs; by the calibrated planner ~690 tokens/s/GPU against ~450 for a
    disaggregated 4 + 4 split of 8 nodes (whose learners sit idle through the rollouts).
    Qwen3-32B has no published base checkpoint; the post-trained model stands in."""
    return colocated(paper_config("qwen3_32b", "Qwen/Qwen3-32B", nodes=4, learner_nodes=0, tp=8, pp=1, engine_tp=4,
                                  template="qwen3"), "qwen3_32b", 0.77, nodes=4)


@recipe(LARGE)
def llama3_70b() -> SpiceConfig:
    """Colocated on 8 nodes: TP=8 x PP=8 learner (10 layers a stage), 16 engines x TP=4 on the same
    GPUs at 0.84 of each; by the calibrated planner ~275 tokens/s/GPU against ~155 for 16 nodes split
    8 + 8 (the smallest disaggregated layout that fits)."""
    return colocated(paper_config("llama3_70b", "meta-llama/Llama-3.3-70B-Instruct", nodes=8, learner_nodes=0, tp=8,
                                  pp=8, engine_tp=4, micro_batch_tokens=8192, template="chat"), "llama3_70b", 0.84,
                     nodes=8)


# Base models beyond the paper's, as reasoning-RL work starts from them (same algorithm and settings).
@recipe(FAMILY)
def qwen2_5_7b() -> SpiceConfig:
    """Qwen2.5-7B base (the architecture of Qwen2.5-Math and DeepSeek-R1-Distill-Qwen too), laid out
    like qwen3_8b: one learner node at TP=2 (4 KV heads: TP 1, 2 or 4), one node of TP=1 engines.
    Its tokenizer's ChatML template frames the prompts."""
    return paper_config("qwen2_5_7b", "Qwen/Qwen2.5-7B", nodes=2, learner_nodes=1, tp=2, pp=1, engine_tp=1,
                        template="chat")


@recipe(FAMILY)
def glm4_5_air() -> SpiceConfig:
    """GLM-4.5-Air base (106B, 12B active) on 10 nodes of 80 GB: 8 learner nodes at TP=8 (within a
    node), PP=2 (46 layers), EP=16 (the experts' Adam state over 64 GPUs is 19 GiB each; on 4
    learner nodes it alone would be 37); 2 engine nodes of 4 engines x TP=4. `spice plan --choose`
    finds a colocated layout on 6 nodes at about twice the tokens/s/GPU (TP=8 PP=2 EP=8, engines
    TP=8 on the learner's GPUs), but run.colocate has run on one node only so far."""
    return _engine_experts(paper_config("glm4_5_air", "zai-org/GLM-4.5-Air-Base", nodes=10, learner_nodes=8, tp=8,
                                        pp=2, ep=16, engine_tp=4, template="chat"))


@recipe(FAMILY)
def deepseek_v3() -> SpiceConfig:
    """DeepSeek-V3-Base (671B, 37B active) on 40 nodes of 80 GB. 61 layers divide no even pipeline
    (uneven stages, parallel.first/last_stage_layers, wait for a planner that models the bubble),
    so the learner is PP=1: 32 nodes at TP=8, EP=256 (one routed expert
    per GPU per MoE layer), full recompute (a 12,288-token sequence's saved activations would be 55
    GiB at TP=8). 1.34 TB of bf16 weights need engines wider than a node: 2 engines x TP=32 (four
    nodes each, vLLM's multi-node tensor parallelism: slurm/rollout_node.sh starts a leader and three
    followers per engine; slurm/spice_deepseek_v3.sbatch). The FP8 checkpoint
    is dequantized on import; engines serve its bf16 copy (`spice convert bf16`, rollout.model)."""
    cfg = _engine_experts(paper_config("deepseek_v3", "deepseek-ai/DeepSeek-V3-Base", nodes=40, learner_nodes=32,
                                       tp=8, pp=1, ep=256, engine_tp=32, template="chat"))
    cfg.train.recompute = "full"
    return cfg


# Mixture-of-experts (beyond the paper, which trains dense models): the same algorithm with expert
# parallelism and routing replay (train.routing_replay "auto": on for MoE). The SPICE authors'
# follow-up trains Qwen3-30B-A3B with EP=8. Experts hold ~96% of the parameters: split over EP they
# fit where the dense layout would not (`spice plan --recipe NAME` prints the expert and all-to-all
# terms).
def _engine_experts(cfg: SpiceConfig) -> SpiceConfig:
    """vLLM's expert parallelism in each engine: its TP GPUs hold whole experts (as vLLM serves
    Qwen3-MoE) instead of a slice of every expert."""
    cfg.rollout.engine_expert_parallel = True
    return cfg


@recipe(MOE)
def qwen3_30b_a3b() -> SpiceConfig:
    """Colocated on 4 nodes (NeMo-RL's GPU count for Qwen3-30B-A3B): TP=4 with sequence parallelism
    and EP=8 inside each node (the experts' all-to-all stays on NVLink), DP=8; 16 engines x TP=2 on
    the same GPUs: faster than 4 nodes split 2 + 2 by the calibrated planner (`spice plan --recipe
    qwen3_30b_a3b` prints both placements; docs/layouts.md's table).
    Activations are planned at the longest sequence, a challenger's 8,395 tokens."""
    return colocated(_engine_experts(paper_config("qwen3_30b_a3b", "Qwen/Qwen3-30B-A3B-Base", nodes=4, learner_nodes=0,
                                                  tp=4, pp=1, ep=8, engine_tp=2, template="qwen3")),
                     "qwen3_30b_a3b", 0.77, nodes=4)


def _recompute_core_attention(cfg: SpiceConfig) -> SpiceConfig:
    """Core attention recomputed in the backward (the attention's forward runs twice; not yet
    measured on a GPU): it then keeps q, k and v alone, not its shared-prefix pieces' outputs (2
    bytes per query element per token per layer), which is what these layouts lack of 90%."""
    cfg.train.recompute, cfg.train.recompute_modules = "selective", ["core_attn"]
    return cfg


@recipe(MOE)
def qwen3_30b_a3b_multinode() -> SpiceConfig:
    """Colocated on 6 nodes: TP=4 x EP=8 inside each node, DP=12 (twelve expert-data-parallel
    replicas shard the experts' optimizer state); 24 engines x TP=2 on the same GPUs (~680
    tokens/s/GPU by the calibrated planner against ~540 split 3 + 3)."""
    return colocated(_engine_experts(paper_config(
        "qwen3_30b_a3b_multinode", "Qwen/Qwen3-30B-A3B-Base", nodes=6, learner_nodes=0, tp=4, pp=1, ep=8,
        engine_tp=2, template="qwen3")), "qwen3_30b_a3b_multinode", 0.77, nodes=6)


@recipe(MOE)
def qwen3_235b_a22b() -> SpiceConfig:
    """H100 nodes (80 GB): 16 learner nodes at TP=4 (sequence parallel) x PP=8 x EP=16, the 94 layers
    in uneven stages (11 on the first and last, 12 on the six between, as NeMo-RL lays it out), every
    layer recomputed in the backward; 4 engine nodes of one TP=8 engine each at 0.92 of the GPU (470 GB
    of bf16 weights leave ~14 GiB of KV cache per GPU). NeMo-RL's 128-GPU figure needs the engines
    colocated at TP=16 across two nodes, which colocated jobs refuse (sleep mode and CUDA IPC stay within a
    node; docs/layouts.md); on 16 nodes `spice plan --choose` takes TP=8 engines on rollout nodes instead.
    Qwen3-235B-A22B has no published base checkpoint: the post-trained model stands in."""
    cfg = _engine_experts(paper_config("qwen3_235b_a22b", "Qwen/Qwen3-235B-A22B", nodes=20, learner_nodes=16, tp=4,
                                       pp=8, ep=16, engine_tp=8, template="qwen3"))
    cfg.parallel.first_stage_layers = cfg.parallel.last_stage_layers = 11
    cfg.train.recompute = "full"
    cfg.rollout.gpu_memory_utilization = 0.92
    return cfg


@recipe(MOE)
def qwen3_235b_a22b_h200() -> SpiceConfig:
    """H200 nodes (141 GB): 16 learner nodes, TP=4 within a node for attention, PP=2 (94 layers),
    EP=16 (the all-to-all crosses two nodes); 8 engine nodes of one TP=8 engine each (470 GB of bf16
    weights leave 58 GB of KV cache per GPU). Core attention recomputed (126.1 GiB of 126.9 planned;
    129.2 without)."""
    return _recompute_core_attention(_engine_experts(paper_config(
        "qwen3_235b_a22b_h200", "Qwen/Qwen3-235B-A22B", nodes=24, learner_nodes=16, tp=4, pp=2, ep=16, engine_tp=8,
        template="qwen3", gpu="h200")))


# The paper's "Strong Challenger" baseline (and its figure 4a ablation): a fixed Qwen3-32B writes the
# tasks from the same corpus and only the reasoner trains. The challenger is served by its own vLLM
# engines, never weight-synced: pass rollout.challenger_engines=http://host:8200,... (for example
# slurm/rollout_node.sh with SPICE_MODEL=/models/Qwen3-32B and SPICE_ENGINE_TP=2 on extra nodes), or
# let the driver start a local engine on challenger_model on the learner node's spare GPUs.
STRONG_CHALLENGER = "Qwen/Qwen3-32B"


def strong_challenger(cfg: SpiceConfig, challenger_model: str = STRONG_CHALLENGER) -> SpiceConfig:
    cfg.run.name += "_strong_challenger"
    cfg.run.output_dir = f"runs/{cfg.run.name}"
    cfg.selfplay.challenger = "model"
    cfg.selfplay.challenger_model = challenger_model
    # the paper's "Qwen3-32B-Instruct": the hybrid model answering directly. In thinking mode most of
    # its 512 / 2,048-token budgets would go to an unfinished <think> block (invalid attempts).
    cfg.selfplay.challenger_template = "qwen3_nothink"
    # 32B of bf16 weights (61 GiB) leave one GPU of 80 GiB almost no KV cache: two GPUs per engine
    cfg.rollout.challenger_engine_tensor_parallel = 2
    return cfg


@recipe(BASELINE)
def qwen3_4b_strong_challenger() -> SpiceConfig:
    return strong_challenger(qwen3_4b())


@recipe(BASELINE)
def qwen3_8b_strong_challenger() -> SpiceConfig:
    return strong_challenger(qwen3_8b())


# One 8-GPU node (run.colocate): the learner and the engines share every GPU and take turns
# (spice_megatron/loop/colocation.py): the engines sleep while the learner steps, the learner's optimizer
# state waits in host memory while they generate, and the weights go through vLLM's CUDA IPC.
# On-policy, as the paper trains. Layouts, engine memory shares and offloads are what
# `spice plan --choose --nodes 1` picks for 8 x H100 80 GB.
def colocated(cfg: SpiceConfig, name: str, engine_memory_share: float, nodes: int = 1) -> SpiceConfig:
    cfg.run.name, cfg.run.output_dir = name, f"runs/{name}"
    cfg.run.colocate = True
    cfg.cluster.nodes, cfg.cluster.learner_nodes = nodes, 0
    cfg.train.max_staleness = 0
    cfg.rollout.weight_transfer = "ipc"
    cfg.rollout.gpu_memory_utilization = engine_memory_share  # beside the learner's resident weights
    # under plain torchrun the driver starts them, one per engine_tensor_parallel GPUs of the node
    cfg.rollout.local_engines = cfg.cluster.gpus_per_node // cfg.rollout.engine_tensor_parallel
    return cfg


@recipe(COLOCATED)
def qwen3_4b_1node() -> SpiceConfig:
    """TP=1, DP=8 learner; 8 engines x TP=1 with 0.77 of each GPU during the rollouts."""
    return colocated(qwen3_4b(), "qwen3_4b_1node", 0.77)


@recipe(COLOCATED)
def qwen3_8b_1node() -> SpiceConfig:
    """TP=2, DP=4 learner; 8 engines x TP=1 with 0.77 of each GPU (`spice plan`: ~2,000 tokens/s/GPU
    against ~1,000 for qwen3_8b's two nodes)."""
    return colocated(qwen3_8b(), "qwen3_8b_1node", 0.77)


@recipe(COLOCATED)
def qwen3_30b_a3b_1node() -> SpiceConfig:
    """TP=4 with EP=8 on one node: one expert-data-parallel replica holds every expert's Adam state,
    which does not fit beside the step's activations and the sleeping engines' ~7 GiB on 80 GB, so
    half of the optimizer's state and update runs on the host (megatron-core's HybridDeviceOptimizer,
    optim.cpu_offload_fraction=0.5) and the MoE layers are recomputed in the backward (recompute
    moe: faster by the planner than offloading more). 4 engines x TP=2 with vLLM's expert parallelism."""
    cfg = colocated(qwen3_30b_a3b(), "qwen3_30b_a3b_1node", 0.77)
    cfg.optim.cpu_offload_fraction = 0.5
    cfg.train.recompute, cfg.train.recompute_modules = "selective", ["moe"]
    return cfg
