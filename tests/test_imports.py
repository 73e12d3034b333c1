"""The layout a newcomer reads (tools/checks/module_map.py): no import circle between files, the rooms
(the package's modules and subpackages, recipes/, tools/) in floors with at most one import
running up them, and no module so long that it is several concerns. Every import counts, at the
top or inside a function (a function-level import is how a circle hides until the call)."""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "checks"))

import module_map  # noqa: E402

LONGEST_MODULE = 400
LONGEST_ITERATION = 60  # trainer._train: generate -> train -> sync -> log/save


def test_no_import_circle_between_files():
    found = module_map.imports()
    modules = {i.module for i in found}
    assert {"spice_megatron.trainer", "spice_megatron.policy.learner", "tools.checks.learning_runs"} <= modules
    assert module_map.file_cycle(found) == []


def test_the_rooms_stand_in_floors_with_one_import_running_up():
    floor = module_map.floors()  # raises, naming the imports, on a circle between rooms
    assert len(module_map.UPWARD) <= 1
    assert floor["spice_megatron/cli/"] > floor["spice_megatron/trainer.py"] > floor["spice_megatron/policy/"]
    assert floor["recipes/"] < floor["spice_megatron/cli/"]  # recipes/ holds configs only
    arrows = module_map.room_arrows()
    for (a, b), reason in module_map.UPWARD.items():  # an allowed exception still exists and runs up
        assert (a, b) in arrows and floor[a] <= floor[b] and reason


def test_no_import_reaches_up_a_layer():
    assert module_map.against_layers() == []
    placed = [room for _, rooms in module_map.LAYERS for room in rooms]
    assert len(placed) == len(set(placed))
    assert {module_map.room_of(f) for f in module_map.source_files()} == set(placed)  # every room has a layer


def test_the_layer_check_finds_an_import_against_the_layers():
    bad = module_map.Import("spice_megatron/selfplay/loss.py", 3, "spice_megatron.policy.learner")
    assert module_map.against_layers({("spice_megatron/selfplay/", "spice_megatron/policy/"): [bad]}) == [
        "spice_megatron/selfplay/loss.py:3 imports spice_megatron.policy.learner (algorithm -> learner)"]


TOP_MODULES = 8  # what every layer shares, and the loop a reader starts with (trainer.py)


def test_the_package_top_holds_few_modules():
    top = sorted(n for n in os.listdir(os.path.join(ROOT, "spice_megatron")) if n.endswith(".py"))
    assert len(top) <= TOP_MODULES, top


def test_the_circle_finder_finds_a_circle():
    assert module_map.find_cycle({("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")}) == ["a", "b", "c", "a"]
    assert module_map.find_cycle({("a", "b"), ("b", "c"), ("d", "a")}) == []


def test_no_module_over_400_lines():
    long = {f: n for f in module_map.source_files()
            if (n := sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8"))) > LONGEST_MODULE}
    assert long == {}, f"modules over {LONGEST_MODULE} lines: {long}"


def test_the_iteration_reads_in_60_lines():
    tree = ast.parse(open(os.path.join(ROOT, "spice_megatron", "trainer.py")).read())
    train = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_train")
    assert train.end_lineno - train.lineno + 1 <= LONGEST_ITERATION
