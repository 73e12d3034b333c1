"""Staging a recipe's hub corpus for offline jobs (`spice prepare --recipe NAME`). The hub itself
cannot be reached here: a stand-in for `datasets.load_dataset(hub_id, streaming=True)` yields
records the way a streamed hub dataset does."""
import json
import os

import pytest

from spice_megatron.config import CorpusConfig, SourceConfig
from spice_megatron.data.corpus import Corpus, CorpusError, StagingError, resolve_sources
from spice_megatron.data.corpus_stage import MANIFEST, stage_corpus


def _hub_stand_in(monkeypatch, calls):
    import spice_megatron.data.sources as sources

    def fake(builder_or_id, src, data_files):
        if data_files is not None:  # local json/parquet files still go through datasets
            raise AssertionError("unexpected local read")
        calls.append(builder_or_id)
        for i in range(1000):  # a stream: the stager must stop by itself
            if i == 3:
                yield {"url": "x"}  # no text field: a counted skip
            else:
                yield {"text": f"Document {i} from {builder_or_id}. " + "The quick brown fox jumps. " * 20}
    monkeypatch.setattr(sources, "_iter_datasets", fake)


def _cfg(stage_dir):
    return CorpusConfig(sources=[SourceConfig(path="org/math-docs", name="math", streaming=True, max_records=20),
                                 SourceConfig(path="org/web-docs", name="web", streaming=True, max_records=10)],
                        max_doc_tokens=512, min_doc_tokens=8, max_docs=20, stage_dir=stage_dir)


def test_offline_hub_sources_name_the_staging_step(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _cfg("")
    with pytest.raises(StagingError,
                       match=r"corpus.sources\[0\] \(org/math-docs\).*HF_HUB_OFFLINE.*spice prepare --recipe qwen3_4b"):
        resolve_sources(cfg, "qwen3_4b")
    cfg.stage_dir = str(tmp_path / "staged")
    with pytest.raises(StagingError, match=r"not staged at .*staged/math.jsonl; run `spice prepare --recipe qwen3_4b`"):
        resolve_sources(cfg, "qwen3_4b")


def test_staging_writes_the_first_records_and_jobs_read_it_offline(tmp_path, monkeypatch, qwen3_tokenizer):
    calls = []
    _hub_stand_in(monkeypatch, calls)
    cfg = _cfg(str(tmp_path / "staged"))
    manifest = stage_corpus(cfg)
    assert calls == ["org/math-docs", "org/web-docs"]
    assert manifest["math.jsonl"]["records"] == 19 and manifest["math.jsonl"]["skipped"] == {"missing_field": 1}
    assert manifest["web.jsonl"]["records"] == 9
    lines = open(tmp_path / "staged" / "math.jsonl").read().splitlines()
    assert len(lines) == 19 and json.loads(lines[0])["text"].startswith("Document 0 from org/math-docs")
    assert json.load(open(tmp_path / "staged" / MANIFEST)) == manifest
    stage_corpus(cfg)  # already staged: the hub is not read again
    assert calls == ["org/math-docs", "org/web-docs"]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("spice_megatron.data.sources._iter_datasets",
                        lambda *a: (_ for _ in ()).throw(AssertionError("hub")))
    corpus = Corpus.build(cfg, qwen3_tokenizer)  # the staged copy, offline, with the sources' names
    assert {d.source for d in corpus.documents} == {"math", "web"} and len(corpus.documents) == 18
    assert corpus.documents[0].doc_id.startswith(("math/", "web/"))


def test_the_missing_staging_step_stops_spice_train_at_once(tmp_path, monkeypatch, capsys):
    from spice_megatron.cli import main

    monkeypatch.setenv("SPICE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(["train", "--recipe", "qwen3_4b", "--model", str(tmp_path), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "spice prepare --recipe qwen3_4b" in err and os.path.join("staged", "qwen3_4b") in err
    with pytest.raises(CorpusError, match="spice prepare --recipe qwen3_4b"):
        from recipes import get_recipe
        Corpus.build(get_recipe("qwen3_4b").corpus, None, "qwen3_4b")
