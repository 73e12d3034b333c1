"""Dataclass configs. Each validates itself and names the offending field in its error.

`SpiceConfig` is a run's whole config, one section per concern: the learner's (`learner.py`), the
corpus and self-play (`selfplay.py`), the engines (`rollout.py`), the cluster and the run (here). A
recipe is a Python function returning a fully populated one; `apply_overrides` takes `a.b=value`.

Layer 0, shared (tools/checks/module_map.py's LAYERS): imports `entry.py` only."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from spice_megatron.config.learner import OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.config.rollout import RolloutConfig
from spice_megatron.config.selfplay import CorpusConfig, SelfPlayConfig, SourceConfig
from spice_megatron.entry import ConfigError
from spice_megatron.entry import require as _require

# every section is also spice_megatron.config's: what a recipe or a caller builds a config from
__all__ = ["ConfigError", "CorpusConfig", "OptimConfig", "ParallelConfig", "PolicyTrainConfig", "RolloutConfig",
           "SelfPlayConfig", "SourceConfig"]


DRIVERS = ("thread", "process")  # run.driver


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
    # lock (run/lock.py), to end before it refuses to start.
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
    # Same seeds, same outcome (selfplay/schedule.py); only the engines' idle time differs.
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
