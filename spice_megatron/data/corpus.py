"""The document corpus the challenger reads: loading, cleaning, segmenting, sampling.

Sources are hub datasets (production: Nemotron-CC-Math, NaturalReasoning) or local
jsonl/json/parquet files. Every document keeps its provenance so that any generated task can be
traced to the record it came from. Bad records are skipped and counted by reason, never fatal;
a missing file or an unknown hub id is.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from spice_megatron.config import CorpusConfig, SourceConfig
from spice_megatron.data.sources import CorpusError, is_hub_source, iter_source_records, record_text
from spice_megatron.entry import UserError

log = logging.getLogger(__name__)

class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class Document:
    doc_id: str  # "<source>/<record_index>/<segment_index>": the provenance id in the audit trail
    text: str
    source: str
    record_index: int
    segment_index: int
    sha256: str
    num_tokens: int
    file: str = ""
    license: str = ""


@dataclass
class SourceReport:
    records: int = 0
    documents: int = 0
    segments: int = 0
    skipped: Counter = field(default_factory=Counter)


@dataclass
class CorpusReport:
    sources: dict[str, SourceReport] = field(default_factory=dict)
    pool_size: int = 0

    def summary(self) -> str:
        lines = [f"corpus pool: {self.pool_size} documents"]
        for name, r in self.sources.items():
            skips = ", ".join(f"{k}={v}" for k, v in sorted(r.skipped.items())) or "none"
            lines.append(f"  {name}: {r.records} records -> {r.segments} segments, {r.documents} in pool; "
                         f"skipped: {skips}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- reading sources

# ----------------------------------------------------------------------------- segmentation

_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _hard_split(text: str, tokenizer: Tokenizer, max_tokens: int) -> list[str]:
    """Split text with no usable boundary: the longest prefix within budget, preferring a space."""
    out = []
    while text:
        if count_tokens(tokenizer, text) <= max_tokens:
            out.append(text)
            break
        lo, hi = 1, len(text)
        while lo < hi:  # largest prefix length that fits
            mid = (lo + hi + 1) // 2
            if count_tokens(tokenizer, text[:mid]) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        cut = text.rfind(" ", 0, lo)
        cut = cut if cut > lo // 2 else lo
        out.append(text[:cut].strip())
        text = text[cut:].strip()
    return [t for t in out if t]


def segment_text(text: str, tokenizer: Tokenizer, max_tokens: int) -> list[str]:
    """Cut text into pieces of at most max_tokens, on paragraph, then sentence boundaries."""
    if count_tokens(tokenizer, text) <= max_tokens:
        return [text]
    units: list[tuple[str, str]] = []  # (piece, separator that precedes it when packed)
    for para in _PARAGRAPH.split(text):
        para = para.strip()
        if not para:
            continue
        if count_tokens(tokenizer, para) <= max_tokens:
            units.append((para, "\n\n"))
            continue
        for j, sent in enumerate(_SENTENCE.split(para)):
            sep = "\n\n" if j == 0 else " "
            if count_tokens(tokenizer, sent) <= max_tokens:
                units.append((sent, sep))
            else:
                units.extend((piece, sep if k == 0 else " ")
                             for k, piece in enumerate(_hard_split(sent, tokenizer, max_tokens)))
    segments, current, used = [], "", 0
    for piece, sep in units:
        n = count_tokens(tokenizer, piece)
        if current and used + n + 1 > max_tokens:
            segments.append(current)
            current, used = "", 0
        current = piece if not current else current + sep + piece
        used += n + (1 if used else 0)
    if current:
        segments.append(current)
    # Token counts of joined text can differ slightly from the sum of the parts: re-check.
    checked = []
    for seg in segments:
        checked.extend([seg] if count_tokens(tokenizer, seg) <= max_tokens else _hard_split(seg, tokenizer, max_tokens))
    return checked


# ----------------------------------------------------------------------------- the pool

def _source_name(src: SourceConfig) -> str:
    if src.name:
        return src.name
    base = os.path.basename(src.path.rstrip("/")) or src.path
    return re.sub(r"(\.jsonl\.gz|\.jsonl|\.json|\.parquet)$", "", base).replace("*", "_")


def load_source_documents(src: SourceConfig, cfg: CorpusConfig, tokenizer: Tokenizer, seen: set[str],
                          report: SourceReport) -> list[Document]:
    from tqdm.auto import tqdm

    name = _source_name(src)
    docs: list[Document] = []
    records = iter_source_records(src, cfg.max_record_bytes, report.skipped)
    for file, index, rec in tqdm(records, desc=f"corpus {name}", unit="rec", mininterval=2.0,
                                 disable=not log.isEnabledFor(logging.INFO)):
        if src.max_records is not None and report.records >= src.max_records:
            break
        report.records += 1
        text, reason = record_text(rec, src.text_field, cfg.max_record_bytes)
        if reason:
            report.skipped[reason] += 1
            continue
        for seg_index, seg in enumerate(segment_text(text, tokenizer, cfg.max_doc_tokens)):
            report.segments += 1
            n = count_tokens(tokenizer, seg)
            if n < cfg.min_doc_tokens:
                report.skipped["too_short"] += 1
                continue
            digest = hashlib.sha256(seg.encode("utf-8")).hexdigest()
            if digest in seen:
                report.skipped["duplicate"] += 1
                continue
            seen.add(digest)
            docs.append(Document(f"{name}/{index}/{seg_index}", seg, name, index, seg_index, digest, n,
                                 os.path.basename(file), src.license))
    return docs


def _quotas(sizes: list[int], weights: list[float], max_docs: int | None) -> list[int]:
    """Documents to take from each source so the pool mixes them by weight without repeats."""
    shares = [w / sum(weights) for w in weights]
    # The largest pool in which every source can fill its share from distinct documents.
    total = min(int(n / s) for n, s in zip(sizes, shares))
    if max_docs is not None:
        total = min(total, max_docs)
    return [min(n, int(round(total * s))) for n, s in zip(sizes, shares)]


# ----------------------------------------------------------------------------- staged hub sources

class StagingError(UserError, RuntimeError):
    pass


def staged_path(src: SourceConfig, stage_dir: str) -> str:
    return os.path.join(stage_dir, f"{_source_name(src)}.jsonl")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or \
        os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes")


def resolve_sources(cfg: CorpusConfig, recipe: str = "") -> list[SourceConfig]:
    """The sources to read: hub sources replaced by their staged files when the config has a
    stage_dir. A hub source that cannot be read (not staged, or the hub is off) is an error that
    names the step to run."""
    how = f"spice prepare --recipe {recipe}" if recipe else "spice prepare --recipe NAME"
    out = []
    for i, src in enumerate(cfg.sources):
        if not is_hub_source(src):
            out.append(src)
            continue
        if cfg.stage_dir:
            path = staged_path(src, cfg.stage_dir)
            if not os.path.exists(path):
                raise StagingError(f"corpus.sources[{i}] ({src.path}): not staged at {path}; run `{how}` once on a "
                                   "node with hub access (jobs run with HF_HUB_OFFLINE=1)")
            out.append(replace(src, path=path, text_field="text", hub_config=None, streaming=False,
                               max_records=None, name=_source_name(src)))
        elif hub_offline():
            raise StagingError(f"corpus.sources[{i}] ({src.path}) is a hub dataset but HF_HUB_OFFLINE is set; set "
                               f"corpus.stage_dir and run `{how}` on a node with hub access")
        else:
            out.append(src)
    return out


class Corpus:
    """The fixed document pool of a run, built once from the configured sources."""

    def __init__(self, documents: list[Document], report: CorpusReport):
        if not documents:
            raise CorpusError("the corpus is empty after filtering: " + report.summary())
        self.documents = documents
        self.report = report

    @classmethod
    def build(cls, cfg: CorpusConfig, tokenizer: Tokenizer, recipe: str = "") -> "Corpus":
        cfg.validate()
        try:
            sources = resolve_sources(cfg, recipe)
        except StagingError as e:
            raise CorpusError(str(e)) from None
        report, seen, per_source = CorpusReport(), set(), []
        for src in sources:
            sr = report.sources.setdefault(_source_name(src), SourceReport())
            per_source.append(load_source_documents(src, cfg, tokenizer, seen, sr))
        quotas = _quotas([len(d) for d in per_source], [s.weight for s in sources], cfg.max_docs)
        rng = np.random.default_rng(cfg.seed)
        pool: list[Document] = []
        for src, docs, quota in zip(sources, per_source, quotas):
            keep = sorted(rng.choice(len(docs), size=quota, replace=False)) if quota < len(docs) else range(len(docs))
            chosen = [docs[i] for i in keep]
            report.sources[_source_name(src)].documents = len(chosen)
            pool.extend(chosen)
        report.pool_size = len(pool)
        for name, r in report.sources.items():
            if r.skipped:
                log.warning("corpus source %s: skipped %s", name, dict(r.skipped))
        log.info(report.summary())
        return cls(pool, report)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.sha256.encode())
        return h.hexdigest()[:16]

    def save_jsonl(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for d in self.documents:
                f.write(json.dumps(asdict(d), ensure_ascii=False) + "\n")


class DocumentSampler:
    """Uniform, seeded sampling without replacement within an epoch, with an exact resume point.

    Each epoch is a fresh permutation of the pool drawn from (seed, epoch); the cursor is the
    position in it. Restoring the state reproduces the same documents in the same order.
    """

    def __init__(self, corpus: Corpus, seed: int):
        self.corpus, self.seed = corpus, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.corpus.documents))

    def next_batch(self, n: int) -> list[Document]:
        out = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self.corpus.documents[i] for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "fingerprint": self.corpus.fingerprint(), "num_docs": len(self.corpus.documents)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fp = self.corpus.fingerprint()
        if state.get("fingerprint") != fp:
            raise CorpusError(f"cannot resume the corpus cursor: the checkpoint's pool fingerprint "
                              f"{state.get('fingerprint')} ({state.get('num_docs')} docs) differs from this "
                              f"corpus's {fp} ({len(self.corpus.documents)} docs); the sources changed")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)


def load_tokenizer(path: str):
    """The policy's tokenizer (an HF directory or hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
