#!/usr/bin/env python3
"""The tables in README.md and docs/ that the code can produce: recipe layouts and memory
(`spice plan`), the planner's step-time estimates, and config defaults. Each lives between

  <!-- generated: NAME (tools/docs_tables.py) -->
  ...
  <!-- end generated -->

  python tools/docs_tables.py           # rewrite every generated block from the code
  python tools/docs_tables.py --check   # exit 1, naming the block, if any differs (tests/test_docs.py)

Measured figures (benchmarks, learning checks) are not generated: they keep their date and machine;
the ablation table lays out the figures of the run committed in docs/data/ablation_summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BLOCK = re.compile(r"(<!-- generated: (\w+) \(tools/docs_tables\.py\) -->\n)(.*?)(<!-- end generated -->)", re.S)


def _plan(name: str, nodes: int | None = None):
    from recipes import get_recipe
    from spice_megatron.plan.planner import model_spec, plan_layout
    from spice_megatron.plan.step_time import estimate_step_time

    cfg = get_recipe(name)
    if nodes is not None:
        cfg.cluster.nodes, cfg.cluster.learner_nodes = nodes, 0
    spec = model_spec(cfg.run.model)
    plan = plan_layout(cfg, spec)
    return cfg, plan, estimate_step_time(plan, spec, cfg)


def recipes_table() -> str:
    """Every GPU recipe: model, nodes, the learner's layout and planned GiB per GPU, the engines."""
    from recipes import BASELINE_RECIPES, COLOCATED_RECIPES, FAMILY_RECIPES, LARGE_RECIPES, MOE_RECIPES, PAPER_RECIPES

    rows = ["| recipe | model | nodes x GPUs | learner | planned per GPU | engines |", "|---|---|---|---|---|---|"]
    for name in (*PAPER_RECIPES, *BASELINE_RECIPES, *LARGE_RECIPES, *MOE_RECIPES, *COLOCATED_RECIPES,
                 *FAMILY_RECIPES):
        cfg, plan, _ = _plan(name)
        layout = f"{plan.learner.gpus} GPUs: TP={plan.learner.tp} PP={plan.learner.pp} DP={plan.learner.dp}" + (
            f" EP={plan.learner.ep}" if plan.learner.ep > 1 else "")
        planned, engines = f"{plan.learner.memory.total:.1f} GiB", f"{plan.engines.count} x TP={plan.engines.tp}"
        if plan.colocated:  # the largest of the three phases' peaks
            planned = f"{max(plan.phases.train_gib, plan.phases.rollout_gib, plan.phases.sync_gib):.1f} GiB"
            engines += " on the same GPUs"
        rows.append(f"| `{name}` | {cfg.run.model} | {plan.nodes} x {plan.gpus_per_node} ({plan.gpu_memory_gib:.0f} "
                    "GB) "
                    f"| {layout} | {planned} | {engines} |")
    return "\n".join(rows)


def placements_table() -> str:
    """Colocated beside disaggregated on each recipe's own cluster (`spice plan` prints the same)."""
    from recipes import get_recipe
    from spice_megatron.plan.choice import compare_placements
    from spice_megatron.plan.planner import model_spec

    rows = ["| recipe | nodes | placement | learner | engines | s/iteration | tokens/s/GPU |",
            "|---|---|---|---|---|---|---|"]
    for name in ("qwen3_8b", "qwen3_8b_1node", "qwen3_30b_a3b", "qwen3_30b_a3b_1node"):
        cfg = get_recipe(name)
        for placement, value in compare_placements(cfg, model_spec(cfg.run.model)).items():
            if isinstance(value, str):
                rows.append(f"| `{name}` | {cfg.cluster.nodes} | {placement} | does not fit | | | |")
                continue
            p, st = value
            lp = p.learner
            learner = f"TP={lp.tp} PP={lp.pp} DP={lp.dp}" + (f" EP={lp.ep}" if lp.ep > 1 else "") + (
                f", optimizer {lp.optimizer_offload:.0%} on host" if lp.optimizer_offload else "")
            rows.append(f"| `{name}` | {cfg.cluster.nodes} | {placement} | {learner} | {p.engines.count} x "
                        f"TP={p.engines.tp} | {st['total']:.0f} | {st['tokens_per_s_per_gpu']:,.0f} |")
    return "\n".join(rows)


def step_time_table() -> str:
    """qwen3_8b's estimated seconds per iteration at 2, 4 and 8 nodes (`spice plan --nodes N`)."""
    rows = ["| nodes (8 x H100) | learner | rollout | challenger (phased) | reasoner (phased) | rollouts phased "
            "| rollouts streamed | train | sync | s/iteration (streamed) | 640 iterations | tokens/s/GPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for nodes in (2, 4, 8):
        cfg, plan, s = _plan("qwen3_8b", nodes)
        lp = plan.learner
        rows.append(f"| {nodes} | {lp.gpus} GPUs, TP={lp.tp} DP={lp.dp} | {plan.engines.count} engines "
                    f"| {s['challenger_rollout']:.0f} s | {s['reasoner_rollout']:.0f} s | {s['rollout_phased']:.0f} s "
                    f"| {s['rollout_streamed']:.0f} s ({s['rollout_phased'] / s['rollout_streamed']:.2f}x) "
                    f"| {s['train']:.0f} s | {s['weight_sync']:.0f} s | {s['total']:.0f} "
                    f"| {s['total'] * cfg.run.iterations / 3600:.0f} h | {s['tokens_per_s_per_gpu']:,.0f} |")
    return "\n".join(rows)


def calibration_table() -> str:
    """The planner on NeMo-RL's published H100 GRPO runs (spice_megatron/plan/calibration.py)."""
    from spice_megatron.plan.calibration import calibration_rows

    rows = ["| NeMo-RL run (release) | GPUs | generation TP | training TP, CP, EP, PP | published s/step "
            "| modelled s/step (generation + learner) | published tokens/s/GPU | modelled | modelled / published |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, run, st in calibration_rows():
        learner = sum(v for k, v in st.items() if k.startswith("train_"))
        rows.append(f"| {name} ({run.release}) | {run.gpus} | {run.engine_tp} | {run.tp}, {run.cp}, {run.ep}, {run.pp} "
                    f"| {run.step_s:.0f} | {st['total']:.0f} ({st['generation']:.0f} + {learner:.0f}) "
                    f"| {run.tokens_per_s_per_gpu:,.1f} | {st['tokens_per_s_per_gpu']:,.1f} "
                    f"| {st['tokens_per_s_per_gpu'] / run.tokens_per_s_per_gpu:.2f} |")
    return "\n".join(rows)


# NeMo-RL's published models beside the recipe for the same model (the 8B row: Llama-3.1-8B's
# architecture is OctoThinker-8B's)
PUBLISHED_RECIPES = {"Llama-3.1-8B-Instruct": "octothinker_8b", "Qwen3-32B": "qwen3_32b",
                     "Qwen3-30B-A3B": "qwen3_30b_a3b", "Qwen3-235B-A22B": "qwen3_235b_a22b"}


def recipes_vs_published_table() -> str:
    """Each recipe for a model NeMo-RL publishes, as laid out and on NeMo-RL's GPU count (the
    planner's choice there), beside the published tokens/s/GPU (spice_megatron/plan/calibration.py)."""
    from recipes import get_recipe
    from spice_megatron.plan.calibration import PUBLISHED_RUNS
    from spice_megatron.plan.choice import choose_plan, compare_placements
    from spice_megatron.plan.planner import PlanError, model_spec
    from spice_megatron.plan.step_time import estimate_step_time

    rows = ["| model | NeMo-RL (GPUs) | recipe | as laid out: GPUs, tokens/s/GPU | on NeMo-RL's GPU count |",
            "|---|---|---|---|---|"]
    for name, recipe in PUBLISHED_RECIPES.items():
        run = PUBLISHED_RUNS[name]
        cfg, plan, step = _plan(recipe)
        same = get_recipe(recipe)
        same.cluster.gpu, same.cluster.gpu_memory_gib = "h100", 80.0
        same.cluster.nodes, same.cluster.learner_nodes = run.gpus // same.cluster.gpus_per_node, 0
        spec = model_spec(same.run.model)
        try:
            chosen = choose_plan(same, compare_placements(same, spec))
            same.run.colocate = chosen.colocated
            at_same = (f"{estimate_step_time(chosen, spec, same)['tokens_per_s_per_gpu']:,.1f} "
                       f"({'colocated' if chosen.colocated else 'disaggregated'})")
        except PlanError:
            at_same = "no layout fits"
        rows.append(f"| {name} | {run.tokens_per_s_per_gpu:,.1f} ({run.gpus}) | `{recipe}` "
                    f"| {plan.gpus}, {step['tokens_per_s_per_gpu']:,.1f} | {at_same} |")
    return "\n".join(rows)


def _defaults(cls) -> str:
    rows = ["| field | default |", "|---|---|"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            continue
        if dataclasses.is_dataclass(value):
            continue
        rows.append(f"| `{f.name}` | `{value!r}` |")
    return "\n".join(rows)


def run_defaults() -> str:
    from spice_megatron.config import RunConfig

    return _defaults(RunConfig)


def train_defaults() -> str:
    from spice_megatron.config import PolicyTrainConfig

    return _defaults(PolicyTrainConfig)


def bad_inputs_table() -> str:
    """The bad-input matrix of tests/test_bad_input.py: each entry point, the input, what the line names."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_bad_input", os.path.join(ROOT, "tests", "test_bad_input.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    rows = ["| entry point | bad input | the command (`D`: a directory) | the `error:` line names |",
            "|---|---|---|---|"]
    for c in module.CASES:
        argv = module.ENTRY_POINTS[c.entry]
        entry = ("spice " + c.args.split(" ")[0] if c.entry == "spice" else
                 "python -m " + argv[1] if argv[0] == "-m" else os.path.relpath(argv[0], ROOT))
        args = c.args.format(d="D")
        rows.append(f"| `{entry}` | {c.what} | `{args}` | `{c.names.format(d='D')}` |")
    return "\n".join(rows)


def families_table() -> str:
    """The architectures the loader accepts (spice_megatron/families/, one module each)."""
    from spice_megatron.families import FAMILIES

    rows = ["| HF architecture | family (module) | q/k norm | q/k/v bias | experts | latent attention | checkpoints |",
            "|---|---|---|---|---|---|---|"]
    for arch, f in FAMILIES.items():
        yes = {True: "yes", False: "-"}
        rows.append(f"| `{arch}` | [`{f.name}`](../spice_megatron/families/{f.name}.py) | {yes[f.qk_norm]} | "
                    f"{yes[f.qkv_bias]} | {yes[f.experts]} | {yes[f.mla]} | {f.examples} |")
    return "\n".join(rows)


def ranked_layouts_table() -> str:
    """`spice plan --recipe qwen3_32b --rank 6` on the recipe's cluster, beside what --choose takes."""
    from recipes import get_recipe
    from spice_megatron.plan.choice import choose_plan, compare_placements, rank_layouts
    from spice_megatron.plan.planner import model_spec
    from spice_megatron.plan.step_time import estimate_step_time

    cfg = get_recipe("qwen3_32b")
    spec = model_spec(cfg.run.model)
    ranked = rank_layouts(cfg, spec)
    chosen = choose_plan(cfg, compare_placements(cfg, spec))
    rows = ["| rank | placement | learner | engines | learner GiB/GPU | s/iteration | tokens/s/GPU |",
            "|---|---|---|---|---|---|---|"]

    def row(label: str, p, st: dict) -> str:
        lp = p.learner
        layout = (f"TP={lp.tp} PP={lp.pp}" + (f" VPP={lp.vpp}" if lp.vpp > 1 else "")
                  + (f" CP={lp.cp}" if lp.cp > 1 else "") + f" DP={lp.dp}"
                  + (f", recompute {lp.recompute}" if lp.recompute != "off" else ""))
        return (f"| {label} | {'colocated' if p.colocated else 'disaggregated'} | {layout} | {p.engines.count} x "
                f"TP={p.engines.tp} "
                f"| {p.learner.memory.total:.1f} | {st['total']:.1f} | {st['tokens_per_s_per_gpu']:,.0f} |")

    rows += [row(str(i), p, st) for i, (p, st) in enumerate(ranked[:6], 1)]
    rows.append(row(f"`--choose` (of {len(ranked)})", chosen, estimate_step_time(chosen, spec, cfg)))
    return "\n".join(rows)


ABLATION_SUMMARY = os.path.join(ROOT, "docs", "data", "ablation_summary.json")


def ablation_table() -> str:
    """The paper's comparisons at laptop scale, from the last `learning_check.py --ablation` run's
    summary.json as committed in docs/data/ (measured figures: the table only lays them out)."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "tools", "checks"))
    from learning_ablation import markdown_table

    if not os.path.exists(ABLATION_SUMMARY):
        return ("(not run yet: `python tools/checks/learning_check.py --ablation`, then copy its summary.json to "
                "docs/data/)")
    with open(ABLATION_SUMMARY) as f:
        return markdown_table(json.load(f))


def ablation_exact_table() -> str:
    """The committed ablation runs (docs/data/ablation_runs/) with exact paired tests and Holm."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "checks"))
    from learning_ablation import exact_table

    return exact_table(os.path.join(ROOT, "docs", "data", "ablation_runs"))


def ablation_v2_table() -> str:
    """Ablation v2's seeds as committed in docs/data/ablation_v2/, and each arm's verdict."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "checks"))
    from ablation_verdict import markdown_table

    return markdown_table(os.path.join(ROOT, "docs", "data", "ablation_v2"))


def module_map_table() -> str:
    """docs/architecture.md's map: the package's layers top down, each room with its modules and what
    it is (tools/checks/module_map.py)."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "checks"))
    import module_map

    floor = module_map.floors()
    # no line counts: they would make every edit anywhere a docs change (tools/checks/module_map.py prints them)
    rows = ["| layer | room | modules | what it is |", "|---|---|---|---|"]
    for i in range(len(module_map.LAYERS) - 1, -1, -1):
        name, rooms = module_map.LAYERS[i]
        for room in sorted(rooms, key=lambda r: (-floor[r], r)):
            modules = "" if room == "tools/" or not room.endswith("/") else ", ".join(
                os.path.relpath(f, os.path.join(ROOT, room)).removesuffix(".py").replace(os.sep, ".")
                for f in module_map.source_files() if f.startswith(room) and not f.endswith("__init__.py"))
            rows.append(f"| {i} {name} | `{room}` | {modules} | {module_map.room_summary(room).replace('|', '/')} |")
    return "\n".join(rows)


def metrics_table() -> str:
    """docs/metrics.md: the metrics contract (spice_megatron/metric_names.py)."""
    from spice_megatron.metric_names import glossary_table

    return glossary_table()


TABLES: dict[str, Callable[[], str]] = {"metrics": metrics_table, "module_map": module_map_table,
                                        "recipes": recipes_table, "step_time": step_time_table,
                                        "placements": placements_table,
                                        "run_defaults": run_defaults, "train_defaults": train_defaults,
                                        "bad_inputs": bad_inputs_table, "ablation": ablation_table,
                                        "ablation_exact": ablation_exact_table, "ablation_v2": ablation_v2_table,
                                        "families": families_table, "calibration": calibration_table,
                                        "recipes_vs_published": recipes_vs_published_table,
                                        "ranked_layouts": ranked_layouts_table}


def doc_files() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def render(text: str, tables: dict[str, str]) -> str:
    def block(m: re.Match) -> str:
        if m.group(2) not in tables:
            raise KeyError(f"generated block {m.group(2)!r}: no such table ({', '.join(TABLES)})")
        return m.group(1) + tables[m.group(2)] + "\n" + m.group(4)

    return BLOCK.sub(block, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated block differs from the code")
    args = ap.parse_args()
    used = {m.group(2) for path in doc_files() for m in BLOCK.finditer(open(path).read())}
    tables = {name: TABLES[name]() for name in used if name in TABLES}
    stale = []
    for path in doc_files():
        text = open(path).read()
        new = render(text, tables)
        if new != text:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    if args.check and stale:
        print(f"docs differ from the code in {', '.join(stale)}: run python tools/docs_tables.py", file=sys.stderr)
        return 1
    print(("stale: " + ", ".join(stale)) if stale and args.check else
          f"{'checked' if args.check else 'wrote'} {len(used)} generated table(s) in {len(doc_files())} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
