import json

import pytest

from spice_megatron.config import ConfigError, CorpusConfig, SourceConfig
from spice_megatron.data.corpus import Corpus, CorpusError, DocumentSampler, segment_text

PARA = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall and was the "
        "tallest man-made structure for 41 years. Its lattice is made of puddle iron.")


def write_jsonl(path, rows):
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return str(path)


def texts(n, prefix="doc"):
    return [{"text": f"{prefix} {i}. {PARA}"} for i in range(n)]


def build(tok, *sources, **kw):
    kw.setdefault("min_doc_tokens", 8)
    kw.setdefault("max_docs", None)
    return Corpus.build(CorpusConfig(sources=list(sources), **kw), tok)


def test_bad_records_are_skipped_and_counted(tmp_path, qwen3_tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [
        *texts(3),
        {"body": "no text field"},
        {"text": 12345},
        {"text": "   \n  "},
        b"\xff\xfe not utf-8 \xc3\x28\n",
        b'{"text": "truncated json\n',
        json.dumps({"text": "x" * (50 * 1024 * 1024)}).encode() + b"\n",  # a 50 MB record
        [1, 2, 3],
        {"text": None},
        {"text": "tiny"},
        texts(1)[0],  # exact duplicate of the first record
        {"text": "last good one. " + PARA},
    ])
    corpus = build(qwen3_tokenizer, SourceConfig(path=path, name="c"), max_record_bytes=8 * 1024 * 1024)
    r = corpus.report.sources["c"]
    assert dict(r.skipped) == {"missing_field": 2, "not_string": 1, "empty": 1, "undecodable": 1,
                               "malformed_json": 1, "too_large": 1, "not_an_object": 1, "too_short": 1,
                               "duplicate": 1}
    assert [d.record_index for d in corpus.documents] == [0, 1, 2, 13]
    assert "skipped" in corpus.report.summary()


def test_provenance(tmp_path, qwen3_tokenizer):
    import hashlib

    path = write_jsonl(tmp_path / "wiki.jsonl", texts(2))
    d = build(qwen3_tokenizer, SourceConfig(path=path, license="CC-BY-SA-4.0")).documents[1]
    assert d.doc_id == "wiki/1/0" and d.source == "wiki" and d.record_index == 1 and d.segment_index == 0
    assert d.sha256 == hashlib.sha256(d.text.encode()).hexdigest() and d.file == "wiki.jsonl"
    assert d.license == "CC-BY-SA-4.0" and d.num_tokens == len(qwen3_tokenizer.encode(d.text))


def test_missing_file_and_unknown_hub_id_name_the_source(tmp_path, qwen3_tokenizer):
    with pytest.raises(CorpusError, match="nope.jsonl"):
        build(qwen3_tokenizer, SourceConfig(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(CorpusError, match="no-such-org/no-such-dataset"):
        build(qwen3_tokenizer, SourceConfig(path="no-such-org/no-such-dataset"))


def test_json_array_parquet_and_glob_through_datasets(tmp_path, qwen3_tokenizer):
    import datasets

    (tmp_path / "a.json").write_text(json.dumps([{"content": f"array {i}. {PARA}"} for i in range(3)]))
    datasets.Dataset.from_list([{"content": f"parquet {i}. {PARA}"} for i in range(4)]).to_parquet(
        str(tmp_path / "p.parquet"))
    corpus = build(qwen3_tokenizer, SourceConfig(path=str(tmp_path / "a.json"), text_field="content", weight=3),
                   SourceConfig(path=str(tmp_path / "*.parquet"), text_field="content", name="pq", weight=4))
    assert sorted(d.text.split(".")[0] for d in corpus.documents) == \
        ["array 0", "array 1", "array 2", "parquet 0", "parquet 1", "parquet 2", "parquet 3"]
    assert {d.source for d in corpus.documents} == {"a", "pq"}


def test_segmentation_respects_budget_and_boundaries(qwen3_tokenizer):
    paragraphs = [f"Paragraph {i}. " + " ".join(f"Sentence {i}.{j} has some words in it." for j in range(12))
                  for i in range(10)]
    text = "\n\n".join(paragraphs)
    segs = segment_text(text, qwen3_tokenizer, max_tokens=200)
    assert len(segs) > 1
    assert all(len(qwen3_tokenizer.encode(s)) <= 200 for s in segs)
    assert all(s.startswith("Paragraph") or s.startswith("Sentence") for s in segs)  # cut on boundaries
    assert " ".join(" ".join(segs).split()) == " ".join(text.split())  # nothing lost
    # A single run-on "sentence" with no boundary is still cut to budget.
    blob = "word " * 3000
    assert all(len(qwen3_tokenizer.encode(s)) <= 100 for s in segment_text(blob, qwen3_tokenizer, 100))


def test_weighted_mix(tmp_path, qwen3_tokenizer):
    a = write_jsonl(tmp_path / "math.jsonl", texts(40, "math"))
    b = write_jsonl(tmp_path / "general.jsonl", texts(100, "general"))
    corpus = build(qwen3_tokenizer, SourceConfig(path=a, weight=1.0), SourceConfig(path=b, weight=3.0))
    counts = {s: sum(d.source == s for d in corpus.documents) for s in ("math", "general")}
    assert counts == {"math": 33, "general": 100}  # 100 general docs bound the pool at 133, shares 1:3
    capped = build(qwen3_tokenizer, SourceConfig(path=a), SourceConfig(path=b), max_docs=20)
    assert {s: sum(d.source == s for d in capped.documents) for s in ("math", "general")} == {"math": 10, "general": 10}


def test_sampler_is_uniform_without_repeats_and_resumes_exactly(tmp_path, qwen3_tokenizer):
    corpus = build(qwen3_tokenizer, SourceConfig(path=write_jsonl(tmp_path / "c.jsonl", texts(10))))
    s = DocumentSampler(corpus, seed=7)
    first_epoch = [d.doc_id for d in s.next_batch(4)] + [d.doc_id for d in s.next_batch(6)]
    assert sorted(first_epoch) == sorted(d.doc_id for d in corpus.documents)  # each exactly once
    s.next_batch(3)
    state = json.loads(json.dumps(s.state_dict()))
    expected = [d.doc_id for d in s.next_batch(12)]  # crosses into a third epoch
    fresh = DocumentSampler(corpus, seed=0)
    fresh.load_state_dict(state)
    assert [d.doc_id for d in fresh.next_batch(12)] == expected
    assert state["epoch"] == 1 and state["position"] == 3


def test_resume_on_a_different_corpus_is_refused(tmp_path, qwen3_tokenizer):
    c1 = build(qwen3_tokenizer, SourceConfig(path=write_jsonl(tmp_path / "a.jsonl", texts(5))))
    c2 = build(qwen3_tokenizer, SourceConfig(path=write_jsonl(tmp_path / "b.jsonl", texts(6))))
    with pytest.raises(CorpusError, match="fingerprint"):
        DocumentSampler(c2, 0).load_state_dict(DocumentSampler(c1, 0).state_dict())


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"corpus.sources\[0\].weight"):
        CorpusConfig(sources=[SourceConfig(path="x.jsonl", weight=0)]).validate()
    with pytest.raises(ConfigError, match="corpus.sources"):
        CorpusConfig().validate()
    with pytest.raises(ConfigError, match="corpus.min_doc_tokens"):
        CorpusConfig(sources=[SourceConfig(path="x.jsonl")], min_doc_tokens=9000).validate()


def test_empty_corpus_is_a_clear_error(tmp_path, qwen3_tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"body": 1}])
    with pytest.raises(CorpusError, match="empty"):
        build(qwen3_tokenizer, SourceConfig(path=path))
