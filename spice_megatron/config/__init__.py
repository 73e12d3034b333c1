"""Dataclass configs. Each validates itself and names the offending field in its error.

Later parts of the system (policy, rollout, trainer) add their own sections; a recipe is a Python
function returning a fully populated config.

Layer 0, shared (tools/checks/module_map.py's LAYERS): imports `entry.py` only."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from spice_megatron.config.learner import OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.entry import ConfigError
from spice_megatron.entry import require as _require

__all__ = ["ConfigError", "OptimConfig", "ParallelConfig", "PolicyTrainConfig"]  # the learner's sections, also here


@dataclass
class SourceConfig:
    """One corpus source: a hub dataset id or local json/jsonl/parquet files (a glob is allowed)."""

    path: str
    name: str = ""  # short label used in provenance ids; defaults to the file/dataset name
    text_field: str = "text"
    split: str = "train"
    hub_config: str | None = None  # the dataset's configuration name on the hub
    weight: float = 1.0  # relative share of the document pool
    streaming: bool = False  # stream hub datasets instead of downloading them whole
    max_records: int | None = None  # stop reading the source after this many records
    license: str = ""

    def validate(self, prefix: str = "source") -> None:
        _require(bool(self.path), f"{prefix}.path", "must be a hub id or a local file/glob")
        _require(bool(self.text_field), f"{prefix}.text_field", "must name the text column")
        _require(self.weight > 0, f"{prefix}.weight", f"must be > 0, got {self.weight}")
        _require(self.max_records is None or self.max_records > 0, f"{prefix}.max_records",
                 f"must be a positive integer or None, got {self.max_records}")


@dataclass
class CorpusConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    max_doc_tokens: int = 5992  # paper: prompt + generation must fit the context window
    min_doc_tokens: int = 32  # shorter segments carry too little to ground a question
    max_docs: int | None = 20000  # paper: a 20,000-document pool
    max_record_bytes: int = 8 * 1024 * 1024  # larger records are skipped, never loaded whole
    seed: int = 1234
    # Where `spice prepare --recipe NAME` stages hub sources as local JSONL; when set, hub sources
    # are read from there (jobs run offline). Empty: hub sources are read from the hub.
    stage_dir: str = ""

    def validate(self, prefix: str = "corpus") -> None:
        _require(len(self.sources) > 0, f"{prefix}.sources", "at least one source is required")
        for i, s in enumerate(self.sources):
            s.validate(f"{prefix}.sources[{i}]")
        _require(self.max_doc_tokens > 0, f"{prefix}.max_doc_tokens", "must be > 0")
        _require(0 <= self.min_doc_tokens < self.max_doc_tokens, f"{prefix}.min_doc_tokens",
                 f"must be in [0, max_doc_tokens={self.max_doc_tokens})")
        _require(self.max_docs is None or self.max_docs > 0, f"{prefix}.max_docs", "must be > 0 or None")
        _require(self.max_record_bytes > 0, f"{prefix}.max_record_bytes", "must be > 0")


CHALLENGER_REWARDS = ("variance", "absolute_zero", "threshold", "r_zero")
CHALLENGER_GROUPS = ("document", "single")
CHALLENGERS = ("self", "model", "tasks")
GROUNDINGS = ("document", "none")
PROTOCOLS = ("paper", "compact")
TEMPLATES = ("plain", "chat", "qwen3", "qwen3_nothink", "octothinker")
LEAK_CHECKS = ("long", "all")  # tasks.py:_leaks
DRIVERS = ("thread", "process")  # run.driver
REASONER_TASKS = ("random", "frontier")  # selfplay.py: the reasoner group of each document


@dataclass
class SelfPlayConfig:
    """Algorithm 1's knobs; the defaults are the paper's settings (SPICE.md)."""

    batch_docs: int = 128  # B
    group_size: int = 8  # G reasoner answers per task (also K for the variance reward)
    max_attempts: int = 1024  # N challenger attempts per document
    attempts_per_round: int = 8  # challenger samples requested per pending document per round
    challenger_temperature: float = 1.0
    reasoner_temperature: float = 1.0
    top_p: float = 1.0
    challenger_max_tokens: int = 1024
    reasoner_max_tokens: int = 2048
    challenger_reward: str = "variance"
    invalid_penalty: float = -0.1  # rho
    # document: Algorithm 1's challenger group, G attempts per document (valid:invalid ratio kept),
    # advantages centred per document, every valid task answered G times. single: one attempt per
    # document (a valid one if any), advantages centred over the batch (compact, cheaper).
    challenger_group: str = "document"
    protocol: str = "paper"  # paper: selection + JSON generation (protocol.py); compact: tagged sections
    selection_max_tokens: int = 512  # the paper protocol's selection step
    template: str = "plain"  # conversation format: plain, chat (the tokenizer's), qwen3, octothinker
    prompt_dir: str = ""  # files that replace the built-in prompts (protocol.py, templates.py)
    # Who writes the tasks. self: the policy (SPICE). model: a fixed challenger model (the paper's
    # "Strong Challenger" baseline) behind its own engines, never weight-synced. tasks: a JSONL task
    # file (task_pool.py). In the fixed modes only reasoner trajectories are trained.
    challenger: str = "self"
    challenger_model: str = ""  # challenger=model: HF directory served by local engines (or rollout.challenger_engines)
    # challenger=model: the fixed challenger's conversation format ("": selfplay.template). The paper's
    # "Qwen3-32B-Instruct" is the hybrid model in non-thinking mode: qwen3_nothink.
    challenger_template: str = ""
    tasks_file: str = ""  # challenger=tasks
    # Strings that end a reasoner answer (kept in its text): few-shot prompts in prompt_dir that show
    # several "Q: ... A: ..." turns need "\nQ:", or the model writes the next turn and its \boxed{}.
    reasoner_stop: list[str] = field(default_factory=list)
    # Which answers found in their own question make a task invalid: long (integers of 3+ digits,
    # strings of 4+ characters; shorter ones occur naturally in questions) or all (tasks.py:_leaks)
    leak_check: str = "long"
    # Which of a document's valid tasks the reasoner trains on. random: the paper's (Algorithm 1). frontier:
    # one drawn at random among those with 0 < pass rate < 1, if any (DAPO's dynamic sampling: a group
    # everyone solved or nobody did has zero advantage and teaches nothing). At a few documents per
    # iteration most random picks are such groups, and the reasoner learns from one or two per step.
    reasoner_task: str = "random"
    # What grounds the challenger's tasks. document: SPICE's (the prompt shows the drawn document).
    # none: the paper's corpus ablation: the prompt's document section is absent, everything else the
    # same; the corpus is still drawn (the schedule) but never shown, the gold answer is the challenger's.
    grounding: str = "document"

    def validate(self, prefix: str = "selfplay") -> None:
        for name in ("batch_docs", "group_size", "max_attempts", "attempts_per_round",
                     "challenger_max_tokens", "reasoner_max_tokens"):
            _require(getattr(self, name) > 0, f"{prefix}.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(self.group_size >= 2, f"{prefix}.group_size", "needs at least 2 answers for a variance")
        for name in ("challenger_temperature", "reasoner_temperature"):
            _require(getattr(self, name) >= 0, f"{prefix}.{name}", "must be >= 0")
        _require(0 < self.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1]")
        _require(self.challenger_reward in CHALLENGER_REWARDS, f"{prefix}.challenger_reward",
                 f"must be one of {CHALLENGER_REWARDS}, got {self.challenger_reward!r}")
        for name, allowed in (("challenger_group", CHALLENGER_GROUPS), ("protocol", PROTOCOLS), ("template", TEMPLATES),
                              ("challenger", CHALLENGERS), ("leak_check", LEAK_CHECKS), ("grounding", GROUNDINGS),
                              ("reasoner_task", REASONER_TASKS)):
            _require(getattr(self, name) in allowed, f"{prefix}.{name}",
                     f"must be one of {allowed}, got {getattr(self, name)!r}")
        _require(not self.challenger_template or self.challenger_template in TEMPLATES, f"{prefix}.challenger_template",
                 f"must be one of {TEMPLATES}, got {self.challenger_template!r}")
        _require(not self.challenger_template or self.challenger == "model", f"{prefix}.challenger_template",
                 "only a fixed challenger (challenger=model) has a template of its own; the policy writes and answers "
                 "in selfplay.template")
        _require(self.selection_max_tokens > 0, f"{prefix}.selection_max_tokens", "must be > 0")
        _require(not self.prompt_dir or os.path.isdir(self.prompt_dir), f"{prefix}.prompt_dir",
                 f"{self.prompt_dir!r} is not a directory")
        _require(self.challenger != "tasks" or os.path.isfile(self.tasks_file), f"{prefix}.tasks_file",
                 f"challenger=tasks needs a JSONL task file; {self.tasks_file!r} is not a file")


def _closest_field(cfg: Any, key: str) -> str:
    """", did you mean X?" for the config field nearest to `key` (its own last name first), or ""."""
    from spice_megatron.entry import did_you_mean

    def leaves(obj: Any, prefix: str = "") -> list[str]:
        out = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            out += leaves(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
        return out

    names = leaves(cfg)
    same_name = [n for n in names if n.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    if len(same_name) == 1:
        return f", did you mean {same_name[0]}?"
    return did_you_mean(key, names)


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply `a.b.c=value` strings to a nested dataclass; values are parsed as the field's type."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"{item}: overrides look like key=value")
        obj, parts = cfg, key.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
                raise ConfigError(f"{'.'.join(parts[:i + 1])}: no such config field{_closest_field(cfg, key)}")
            if i < len(parts) - 1:
                obj = getattr(obj, part)
        current = getattr(obj, parts[-1])
        setattr(obj, parts[-1], _parse_like(raw, current, key))
    return cfg


def _parse_like(raw: str, current: Any, key: str) -> Any:
    if raw.lower() in ("none", "null") and not isinstance(current, str):  # a text field keeps the word
        return None
    if isinstance(current, list):  # lists of strings: comma-separated (rollout.engines=http://a:8100,http://b:8100)
        return [x.strip() for x in raw.split(",") if x.strip()]
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        raise ConfigError(f"{key}: cannot parse {raw!r} as {type(current).__name__}") from None
    return raw


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


# The GPU parts the planner knows (NVIDIA's SXM datasheets): memory as the recipes plan it (GiB),
# dense bf16 TFLOP/s, HBM TB/s. H100 SXM 80 GB: 989, 3.35; H200 SXM 141 GB: 989, 4.8; B200 (DGX
# B200: 1,440 GB and 64 TB/s for 8 GPUs; 2.25 PFLOP/s dense FP16/BF16 each): 180, 2250, 8.0.
GPU_PARTS: dict[str, tuple[float, float, float]] = {
    "h100": (80.0, 989.0, 3.35),
    "h200": (141.0, 989.0, 4.8),
    "b200": (180.0, 2250.0, 8.0),
}


@dataclass
class ClusterConfig:
    """Where a multi-node run goes: the launchers split the nodes into learner and rollout nodes,
    and the planner checks that the layout fits (`spice plan`)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0  # H100 80 GB; H200: 141
    learner_nodes: int = 0  # 0: half of the nodes (rounded down, at least 1); the rest run rollout engines
    gpu: str = "h100"  # the part (GPU_PARTS): the planner's FLOP/s and HBM bandwidth

    def validate(self, prefix: str = "cluster") -> None:
        _require(self.nodes >= 1, f"{prefix}.nodes", "must be >= 1")
        _require(self.gpus_per_node >= 1, f"{prefix}.gpus_per_node", "must be >= 1")
        _require(self.gpu_memory_gib > 0, f"{prefix}.gpu_memory_gib", "must be > 0")
        _require(self.gpu in GPU_PARTS, f"{prefix}.gpu", f"{self.gpu!r}: one of {', '.join(GPU_PARTS)}")
        _require(self.gpu_memory_gib <= GPU_PARTS[self.gpu][0], f"{prefix}.gpu_memory_gib",
                 f"{self.gpu_memory_gib:g} GiB is more than an {self.gpu} holds ({GPU_PARTS[self.gpu][0]:g}); "
                 f"set {prefix}.gpu to the part")
        _require(0 <= self.learner_nodes < self.nodes or (self.nodes == 1 and self.learner_nodes <= 1),
                 f"{prefix}.learner_nodes", f"must leave at least one rollout node (nodes={self.nodes})")

    def split(self) -> tuple[int, int]:
        """(learner nodes, rollout nodes); a single node is shared (GPUs split in half)."""
        if self.nodes == 1:
            return 1, 0
        learner = self.learner_nodes or max(1, self.nodes // 2)
        return learner, self.nodes - learner


@dataclass
class RunConfig:
    name: str = "spice"
    model: str = ""  # HF directory of the base model
    output_dir: str = "runs/spice"
    iterations: int = 640  # T
    checkpoint_every: int = 10
    eval_every: int = 0  # call the evaluation hook every m iterations and at the last (0: never)
    eval_before: bool = True  # with evaluations, measure the base model first (iteration 0)
    keep_last: int = 2
    seed: int = 1234
    export_hf: bool = True  # write an HF checkpoint at the end
    wandb_project: str = ""  # log to Weights & Biases when set
    # kill switch
    min_valid_task_rate: float = 0.0  # stop when the valid-task rate stays below this ...
    patience: int = 5  # ... for this many iterations (also for reward collapse)
    min_challenger_reward: float = -1.0  # stop when the mean challenger reward stays below this
    # How long learner ranks wait for the driver (rank 0) while it alone runs rollouts, evaluation
    # or start-up. The wait is on a gloo group, never under NCCL's 30-minute watchdog.
    driver_timeout: float = 6 * 3600.0
    # Where the driver (corpus, fleet client, verification, records, logs) runs on rank 0's node. thread:
    # inside rank 0, beside its Megatron step (one interpreter lock). process: a process of its own that
    # hands rank 0 finished batches (driver_process.py); the cluster recipes use it.
    driver: str = "thread"
    # How long a requeued Slurm job waits for its earlier attempt, still holding the run directory's
    # lock (run_lock.py), to end before it refuses to start.
    lock_wait_s: float = 300.0
    # The run directory is private (0700, files 0600: it holds prompts, answers and checkpoints, which a
    # resume executes); true: 0750, readable by the owner's group, still writable by the owner alone.
    group_readable: bool = False
    # Learner and rollout engines share every GPU of the job (colocation.py): the engines sleep while
    # the learner steps, the learner's optimizer state and gradients go to host memory while they
    # generate. On-policy only (train.max_staleness=0); on a GPU the weights go through vLLM's CUDA IPC
    # (rollout.weight_transfer=ipc).
    colocate: bool = False
    # Each document's rollouts as soon as it can make them: its next challenger round when its last
    # one gave no valid task, its reasoner request when its group is formed, rather than every
    # document's round r before round r+1 and every challenger before any reasoner (false: phased).
    # Same seeds, same outcome (rollout/schedule.py); only the engines' idle time differs.
    streamed: bool = True

    def validate(self, prefix: str = "run") -> None:
        _require(bool(self.model), f"{prefix}.model", "the base model's HF directory is required")
        _require(self.iterations >= 1, f"{prefix}.iterations", "must be >= 1")
        _require(self.checkpoint_every >= 1, f"{prefix}.checkpoint_every", "must be >= 1")
        _require(self.patience >= 1, f"{prefix}.patience", "must be >= 1")
        _require(self.keep_last >= 1, f"{prefix}.keep_last", "must be >= 1 (2 or more lets a resume pass over "
                 "a damaged newest checkpoint)")
        _require(self.lock_wait_s >= 0, f"{prefix}.lock_wait_s", "must be >= 0 seconds")
        _require(self.driver_timeout > 0, f"{prefix}.driver_timeout", "must be > 0 seconds")
        _require(self.driver in DRIVERS, f"{prefix}.driver", f"must be one of {DRIVERS}, got {self.driver!r}")


@dataclass
class SpiceConfig:
    run: RunConfig = field(default_factory=RunConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    selfplay: SelfPlayConfig = field(default_factory=SelfPlayConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: PolicyTrainConfig = field(default_factory=PolicyTrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def old_logprobs_during_rollouts(self) -> bool:
        """Whether the learner runs its old log-probs during the rollouts (streamed_forward.py): on
        policy, disaggregated, streamed, several optimizer steps per batch, a challenger to stream."""
        t = self.train
        return (self.run.streamed and not self.run.colocate and t.max_staleness == 0 and t.old_logprobs == "forward"
                and (t.trajectories_per_update > 0 or t.steps_per_batch > 1) and self.selfplay.challenger != "tasks")

    @property
    def engine_model(self) -> str:
        """The HF directory the rollout engines serve (rollout.model, else run.model)."""
        return self.rollout.model or self.run.model

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        _require(self.selfplay.challenger != "model" or bool(self.selfplay.challenger_model or
                                                            self.rollout.challenger_engines),
                 "selfplay.challenger_model", "challenger=model needs a model directory or rollout.challenger_engines")
        trained = ("challenger_temperature", "reasoner_temperature") if self.selfplay.challenger == "self" \
            else ("reasoner_temperature",)
        for name in trained:  # the learner's log-probs must be those of the distribution the engine sampled
            _require(getattr(self.selfplay, name) == self.train.temperature, "train.temperature",
                     f"must equal selfplay.{name} ({getattr(self.selfplay, name)}), got {self.train.temperature}")
        _require(self.rollout.weight_transfer != "nccl" or self.parallel.pipeline_parallel == 1,
                 "rollout.weight_transfer", f"nccl (vLLM's) sends from trainer rank 0 alone, which holds only "
                 f"pipeline stage 0 of {self.parallel.pipeline_parallel}: use spice, which sends every stage at once")
        _require(not self.run.colocate or self.train.max_staleness == 0, "train.max_staleness",
                 "must be 0 with run.colocate: colocated engines sleep while the learner steps, so no rollout "
                 "overlaps a step (one step off policy needs engines on GPUs of their own)")
        _require(self.rollout.weight_transfer != "ipc" or self.run.colocate, "rollout.weight_transfer",
                 "ipc hands CUDA memory to engines on the same GPUs: it needs run.colocate=true")
        fixed_challenger_sleeps = self.selfplay.challenger == "model" and not self.rollout.challenger_engines
        _require(not (self.run.colocate and fixed_challenger_sleeps),
                 "rollout.challenger_engines", "run.colocate: a fixed challenger's engine does not sleep; serve it on "
                 "GPUs of its own and name them here")
        _require(not self.run.colocate or self.rollout.weight_transfer in ("ipc", "spice"), "rollout.weight_transfer",
                 "with run.colocate use ipc (GPU) or spice (CPU): nccl cannot put two ranks on one GPU")
        etp, gpus = self.rollout.engine_tensor_parallel, self.cluster.gpus_per_node
        _require(etp <= gpus or etp % gpus == 0, "rollout.engine_tensor_parallel",
                 f"{etp} over nodes of cluster.gpus_per_node={gpus}: an engine wider than a node spans whole nodes "
                 f"(a multiple of {gpus})")
        _require(etp <= gpus or not self.run.colocate, "rollout.engine_tensor_parallel",
                 f"{etp} spans {etp // gpus} nodes of {gpus} GPUs, and colocated engines stay within a node (vLLM's "
                 f"sleep mode and CUDA IPC do not cross nodes): use run.colocate=false with rollout nodes of their own "
                 f"(spice plan --choose picks a layout), or at most {gpus}")
        _require(self.parallel.context_parallel == 1 or self.train.shared_prefix != "on", "parallel.context_parallel",
                 "shared-prefix packed rows cannot be split over context-parallel ranks yet; set train.shared_prefix "
                 "off (auto turns it off)")
