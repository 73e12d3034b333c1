"""The documents and self-play sections of a run's config: `corpus.*` (its sources) and
`selfplay.*` (Algorithm 1's knobs, the paper's settings as defaults), with the choices they allow."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from spice_megatron.entry import require as _require


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
REASONER_TASKS = ("random", "frontier")  # selfplay/iteration.py: the reasoner group of each document


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
