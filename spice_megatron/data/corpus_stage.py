"""Staging hub corpora to local files, once, on a node that can reach the hub.

Cluster jobs run with HF_HUB_OFFLINE=1 (compute nodes often have no internet, and hundreds of ranks
must not hit the hub at once), while the paper recipes name their corpus by hub id. `spice prepare
--recipe NAME` streams the first `max_records` records of each hub source into
`<corpus.stage_dir>/<source name>.jsonl` (text only) plus a manifest; `Corpus.build` then reads the
staged files instead of the hub, and refuses with the command to run when they are missing.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter

from spice_megatron.config import CorpusConfig
from spice_megatron.data.corpus import StagingError, staged_path
from spice_megatron.data.sources import is_hub_source, iter_source_records, record_text

log = logging.getLogger(__name__)

MANIFEST = "STAGED.json"


def stage_corpus(cfg: CorpusConfig, force: bool = False) -> dict:
    """Write each hub source's first max_records texts to stage_dir. Idempotent: a source whose
    staged file matches the manifest is skipped unless `force`. Returns the manifest."""
    from tqdm.auto import tqdm

    if not cfg.stage_dir:
        raise StagingError("corpus.stage_dir: empty; the recipe names no directory to stage its corpus in")
    os.makedirs(cfg.stage_dir, exist_ok=True)
    manifest_path = os.path.join(cfg.stage_dir, MANIFEST)
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    for src in cfg.sources:
        if not is_hub_source(src):
            continue
        path = staged_path(src, cfg.stage_dir)
        key = os.path.basename(path)
        want = {"path": src.path, "hub_config": src.hub_config, "split": src.split, "text_field": src.text_field,
                "max_records": src.max_records}
        if not force and os.path.exists(path) and {k: manifest.get(key, {}).get(k) for k in want} == want:
            log.info("corpus source %s already staged at %s", src.path, path)
            continue
        skipped: Counter = Counter()
        written, t0, tmp = 0, time.perf_counter(), path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            records = iter_source_records(src, cfg.max_record_bytes, skipped)
            for _, _, rec in tqdm(records, desc=f"staging {src.path}", unit="rec", total=src.max_records):
                text, reason = record_text(rec, src.text_field, cfg.max_record_bytes)
                if reason:
                    skipped[reason] += 1
                else:
                    f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    written += 1
                if src.max_records is not None and written + sum(skipped.values()) >= src.max_records:
                    break
        os.replace(tmp, path)  # a staging run that dies leaves no half file behind under the final name
        manifest[key] = {**want, "records": written, "skipped": dict(skipped),
                         "seconds": round(time.perf_counter() - t0, 1)}
        if skipped:
            log.warning("staging %s: skipped %s", src.path, dict(skipped))
        with open(manifest_path + ".tmp", "w") as f:
            json.dump(manifest, f, indent=2)
        os.replace(manifest_path + ".tmp", manifest_path)
        log.info("staged %d records of %s at %s", written, src.path, path)
    return manifest
