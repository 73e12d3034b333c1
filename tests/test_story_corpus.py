"""The demo's story documents: seeded, answer-bearing, and held-out questions apart from them."""
import json
import os

from spice_megatron.config import SourceConfig
from spice_megatron.data import offline_data, story_corpus


def test_stories_state_their_result_and_are_seeded():
    a, b = story_corpus.make_stories(50), story_corpus.make_stories(50)
    assert a == b and len({s.text for s in a}) == 50
    for s in a:
        last = s.text.rstrip(".").split(". ")[-1]  # "Now Gus has 13 cards": the document holds the answer
        assert str(s.answer) in last.split() and str(s.a) in s.question and str(s.b) in s.question


def test_heldout_questions_share_no_number_pair_with_training_documents():
    held = story_corpus.make_heldout(200)
    train = story_corpus.make_stories(5000)  # more than the training pairs: every one of them appears
    train_pairs = {(s.kind, s.a, s.b) for s in train}
    assert len(held) == 200 and not train_pairs & {(s.kind, s.a, s.b) for s in held}
    assert {s.question for s in held}.isdisjoint(s.question for s in train)


def test_prompt_folder_holds_the_files_the_protocol_reads():
    names = set(os.listdir(story_corpus.PROMPT_DIR))
    assert {"challenger_compact.txt", "reasoner.txt"} <= names
    assert "{document}" in open(os.path.join(story_corpus.PROMPT_DIR, "challenger_compact.txt")).read()
    assert open(os.path.join(story_corpus.PROMPT_DIR, "reasoner.txt")).read().rstrip().endswith("Q: {question}\nA:")


def test_prepare_writes_the_stories_when_a_recipe_reads_them(tmp_path):
    path = tmp_path / "data" / "corpus" / "stories.jsonl"
    offline_data.prepare_for([SourceConfig(path=str(path))])  # no wheels: generated text only
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == offline_data.STORY_DOCS and rows[0]["source"] == "stories"
    held = [json.loads(line) for line in (tmp_path / "data" / "eval" / "stories.jsonl").read_text().splitlines()]
    assert held and {"question", "answer", "answer_type"} <= set(held[0])


def test_the_complement_set_asks_every_arithmetic_no_drawn_story_states():
    """Ablation v2's primary endpoint (issue 73): a question for every (kind, a, b) outside the
    stories a seed draws; none of them is answered by a drawn story."""
    stories = story_corpus.make_stories(2000, n_heldout=300)
    drawn = {(s.kind, s.a, s.b) for s in stories[:48]}
    questions = story_corpus.complement(drawn)
    assert len(questions) == len(story_corpus._all_pairs()) - len(drawn)
    assert not {(q.kind, q.a, q.b) for q in questions} & drawn
    assert story_corpus.complement(drawn) == questions  # seeded: the same set every time
