import subprocess
import sys

from spice_megatron.cli import main


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "prepare" in out.stdout and "corpus" in out.stdout


def test_corpus_from_explicit_source(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "The speed of light in vacuum is 299,792,458 metres per second exactly, by definition of the metre. It was fixed in 1983, when the metre was redefined as the distance light travels in 1/299,792,458 of a second."}\n'
                   '{"oops": 1}\n')
    assert main(["corpus", "--source", str(src), "--show", "1"]) == 0
    assert '"doc_id": "docs/0/0"' in capsys.readouterr().out


def test_corpus_reports_missing_file(tmp_path, capsys):
    assert main(["corpus", "--source", str(tmp_path / "missing.jsonl")]) == 1
    assert "missing.jsonl" in capsys.readouterr().err


def test_audit_filters_records(tmp_path, capsys):
    import json

    rows = [{"kind": "challenger", "iteration": 0, "doc_id": "math/1/0", "weights_version": 0, "valid": True,
             "trained": True, "task": {"question": "How many?"}, "reward": 0.8},
            {"kind": "reasoner", "iteration": 0, "doc_id": "math/1/0", "weights_version": 0, "extracted": "4",
             "trained": True, "reward": 1.0},
            {"kind": "challenger", "iteration": 1, "doc_id": "wiki/2/0", "weights_version": 1, "valid": False,
             "trained": False, "reason": "no_question"}]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{torn\n")
    assert main(["audit", str(tmp_path), "--kind", "challenger", "--valid"]) == 0
    out = capsys.readouterr()
    assert "How many?" in out.out and "wiki/2/0" not in out.out and "not valid JSON" in out.err
    assert main(["audit", str(tmp_path), "--version", "1", "--full"]) == 0
    assert json.loads(capsys.readouterr().out)["reason"] == "no_question"
