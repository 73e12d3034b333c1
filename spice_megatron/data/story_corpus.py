"""Short stories with numbers in them: documents the CPU demo model can turn into tasks.

SmolLM2-135M-Instruct cannot write a hard question from a Wikipedia page, so with the demo corpus
every challenger attempt is invalid and every advantage is zero. These stories are the kind of
document it can work with: two or three sentences about a person and a quantity, ending with the
result ("... Now Gus has 13 cards."). As in SPICE's corpus, the document holds the answer: the
challenger reads it off the document as its gold answer, and must keep in the question the
numbers a reasoner (who never sees the document) needs to reach it.

Seeded and deterministic. `make_stories` gives training documents; `make_heldout` gives
evaluation questions from the same kinds of story but with number pairs that no training document
uses, so that no held-out question can be answered from memory of a training document.
"""
from __future__ import annotations

import operator
import os
import random
from dataclasses import dataclass
from typing import Callable

NAMES = ("Gus", "Mia", "Tom", "Lena", "Omar", "Ruth", "Ivan", "Zoe", "Ken", "Ada", "Raj", "Eva", "Sam", "Nora",
         "Leo", "Ana")
THINGS = ("cards", "stamps", "marbles", "shells", "coins", "stickers", "pencils", "books", "apples", "beads")


@dataclass(frozen=True)
class Kind:
    """One kind of story: how the numbers combine, the story, and the question about its result."""

    name: str
    a: range
    b: range
    result: Callable[[int, int], int]  # of a and b
    story: str  # {name} {thing} {a} {b} {result}
    question: str


KINDS = (
    Kind("gain", range(2, 30), range(2, 30), operator.add,
         "{name} had {a} {thing}. A friend gave {name} {b} more {thing}. Now {name} has {result} {thing}.",
         "{name} had {a} {thing} and a friend gave {name} {b} more. How many {thing} does {name} have now?"),
    Kind("loss", range(12, 40), range(2, 12), operator.sub,
         "{name} had {a} {thing}. {name} gave {b} of them away. Now {name} has {result} {thing} left.",
         "{name} had {a} {thing} and gave {b} of them away. How many {thing} does {name} have left?"),
    Kind("boxes", range(2, 10), range(2, 10), operator.mul,
         "Each box holds {a} {thing}. {name} filled {b} boxes. So {name} packed {result} {thing} in all.",
         "Each box holds {a} {thing} and {name} filled {b} boxes. How many {thing} did {name} pack in all?"),
    Kind("days", range(2, 20), range(2, 20), operator.add,
         "On Monday {name} collected {a} {thing}. On Tuesday {name} collected {b} {thing}. "
         "Over the two days {name} collected {result} {thing}.",
         "{name} collected {a} {thing} on Monday and {b} {thing} on Tuesday. How many {thing} did {name} collect "
         "over the two days?"),
)


@dataclass(frozen=True)
class Story:
    kind: str
    a: int
    b: int
    answer: int
    text: str  # the document
    question: str  # a self-contained question about it (held-out evaluation items)


def _story(kind: Kind, a: int, b: int, rng: random.Random) -> Story:
    result = kind.result(a, b)
    fields = {"name": rng.choice(NAMES), "thing": rng.choice(THINGS), "a": a, "b": b, "result": result}
    return Story(kind.name, a, b, result, kind.story.format(**fields), kind.question.format(**fields))


HELDOUT = 300  # held-out questions: `spice prepare`'s eval/stories.jsonl, the main job's and the learning check's


def _all_pairs() -> list[tuple[Kind, int, int]]:
    return [(k, a, b) for k in KINDS for a in k.a for b in k.b]


def _split(seed: int, n_heldout: int) -> tuple[list[tuple[Kind, int, int]], list[tuple[Kind, int, int]]]:
    """Every (kind, a, b) once, shuffled with `seed`: the first n_heldout are held out."""
    pairs = _all_pairs()
    random.Random(seed).shuffle(pairs)
    return pairs[n_heldout:], pairs[:n_heldout]


def make_stories(n: int, seed: int = 7, n_heldout: int = HELDOUT) -> list[Story]:
    """n training documents (cycling through the training pairs with fresh names when n is larger).

    A deliberate trade-off: a second round through a pair can draw the same name as the first, so
    make_stories(2000) holds 4-7 exact repeats, which the corpus's duplicate removal drops (counted:
    1,993-1,996 documents in the pool). Redrawing them would change every seeded document draw that
    the main job's and the learning checks' quoted figures were measured on, for a 0.3% larger pool."""
    train, _ = _split(seed, n_heldout)
    rng = random.Random(seed + 1)
    return [_story(*train[i % len(train)], rng) for i in range(n)]


def make_heldout(n_heldout: int = HELDOUT, seed: int = 7) -> list[Story]:
    """The held-out questions: number pairs no training document of the same `seed` uses."""
    _, held = _split(seed, n_heldout)
    rng = random.Random(seed + 2)
    return [_story(k, a, b, rng) for k, a, b in held]


def corpus_rows(stories: list[Story]) -> list[dict]:
    """Corpus records (corpus.py reads `text`; the rest is provenance)."""
    return [{"text": s.text, "source": "stories", "license": "generated", "kind": s.kind, "answer": s.answer}
            for s in stories]


def complement(drawn: set[tuple[str, int, int]], seed: int = 7) -> list[Story]:
    """A question for every (kind, a, b) no drawn document states (`drawn`: the kind name and
    numbers of the stories a run trains on): the largest held-out set a run's documents leave,
    known before it trains once its document draws are (they follow its seed)."""
    rng = random.Random(seed + 3)
    return [_story(k, a, b, rng) for k, a, b in _all_pairs() if (k.name, a, b) not in drawn]


def eval_rows(stories: list[Story]) -> list[dict]:
    """Evaluation records in the offline benchmark format (question, answer, answer_type)."""
    return [{"id": f"story-{i}", "question": s.question, "answer": str(s.answer), "answer_type": "integer"}
            for i, s in enumerate(stories)]


# The few-shot prompts this model can follow (selfplay.prompt_dir) and the reasoner's stop string:
# its prompt shows "Q: ... A: ..." turns, and the model would write the next one.
PROMPT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prompts", "stories")
REASONER_STOP = ("\nQ:",)
