"""Reading a corpus source's records: local jsonl/json/parquet files (a glob is allowed) line by
line or through `datasets`, or a hub dataset; and the text of one record. A bad record is a counted
skip (by reason), never fatal; a missing file or an unknown hub id is (CorpusError, naming it)."""
from __future__ import annotations

import glob
import gzip
import json
import os
from collections import Counter
from typing import Any, Iterator

from spice_megatron.config import SourceConfig
from spice_megatron.entry import UserError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz")


class CorpusError(UserError, RuntimeError):
    """A source cannot be read at all (missing file, unknown hub id): names the source."""


def _is_local(path: str) -> bool:
    return (os.path.exists(path) or any(c in path for c in "*?[") or path.endswith(LOCAL_SUFFIXES)
            or path.startswith((".", "/", "~")))


def is_hub_source(src: SourceConfig) -> bool:
    return not _is_local(src.path)


def _local_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.expanduser(path)))
    if not files:
        raise CorpusError(f"corpus source {path!r}: no such file (or the glob matches nothing)")
    return files


def _iter_jsonl(path: str, max_bytes: int, skipped: Counter) -> Iterator[tuple[int, Any]]:
    """Line by line, so that one bad line is a counted skip rather than a failed file (the
    `datasets` json builder aborts the whole file on it), and a huge line is never loaded whole."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        index = -1
        while True:
            line = f.readline(max_bytes + 1)
            if not line:
                return
            index += 1
            if len(line) > max_bytes and not line.endswith(b"\n"):
                skipped["too_large"] += 1
                while line and not line.endswith(b"\n"):  # drain the rest of the oversized line
                    line = f.readline(1 << 20)
                continue
            if not line.strip():
                index -= 1  # blank lines are not records
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                skipped["undecodable"] += 1
                continue
            try:
                yield index, json.loads(text)
            except json.JSONDecodeError:
                skipped["malformed_json"] += 1


def _looks_like_json_lines(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return not head.startswith(b"[")


def _iter_datasets(builder_or_id: str, src: SourceConfig, data_files: list[str] | None) -> Iterator[Any]:
    import datasets

    try:
        if data_files is not None:
            ds = datasets.load_dataset(builder_or_id, data_files=data_files, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(builder_or_id, src.hub_config, split=src.split, streaming=src.streaming)
    except Exception as e:  # datasets raises many types here; all mean "cannot read this source"
        what = data_files if data_files is not None else builder_or_id
        raise CorpusError(f"corpus source {src.path!r}: cannot load {what}: {type(e).__name__}: {e}") from e
    yield from ds


def iter_source_records(src: SourceConfig, max_bytes: int, skipped: Counter) -> Iterator[tuple[str, int, Any]]:
    """Yield (file, record_index, record) for one source."""
    if not _is_local(src.path):
        for i, rec in enumerate(_iter_datasets(src.path, src, None)):
            yield src.path, i, rec
        return
    for path in _local_files(src.path):
        if path.endswith((".jsonl", ".jsonl.gz")) or (path.endswith(".json") and _looks_like_json_lines(path)):
            for i, rec in _iter_jsonl(path, max_bytes, skipped):
                yield path, i, rec
        elif path.endswith(".json"):
            for i, rec in enumerate(_iter_datasets("json", src, [path])):
                yield path, i, rec
        elif path.endswith(".parquet"):
            for i, rec in enumerate(_iter_datasets("parquet", src, [path])):
                yield path, i, rec
        else:
            raise CorpusError(f"corpus source {path!r}: unsupported file type (use {', '.join(LOCAL_SUFFIXES)})")


def record_text(rec: Any, text_field: str, max_bytes: int) -> tuple[str | None, str | None]:
    """(text, None) for a usable record, else (None, skip_reason)."""
    if not isinstance(rec, dict):
        return None, "not_an_object"
    if text_field not in rec or rec[text_field] is None:
        return None, "missing_field"
    text = rec[text_field]
    if not isinstance(text, str):
        return None, "not_string"
    if len(text) > max_bytes:
        return None, "too_large"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from a broken producer
        return None, "undecodable"
    text = text.replace("\x00", "").strip()
    if not text:
        return None, "empty"
    return text, None
