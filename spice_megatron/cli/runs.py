"""The `spice` commands that read models and runs: eval, curves, coevolution, audit."""
from __future__ import annotations

import argparse
import json
import os
import sys

from spice_megatron.bridge.preflight import looks_like_local_path
from spice_megatron.entry import UserError


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a model on benchmarks; writes results.md, results.json and items.jsonl."""
    from spice_megatron.eval.benchmarks import benchmark_names
    from spice_megatron.eval.harness import EvalSettings, markdown_table
    from spice_megatron.eval.run import run_evaluation

    try:
        names = benchmark_names(args.benchmarks)
    except ValueError as e:
        raise UserError(str(e)) from None
    if looks_like_local_path(args.model) and not os.path.exists(args.model):
        raise UserError(f"--model {args.model}: no such directory (an HF directory, a SPICE run directory or a "
                        "Megatron checkpoint)")
    template, prompt_dir, stop = args.template, "", ()
    if args.recipe:  # the recipe's training prompts, unless --template names another
        from recipes import get_recipe

        recipe = get_recipe(args.recipe).selfplay
        template, prompt_dir = args.template or recipe.template, recipe.prompt_dir
        stop = tuple(recipe.reasoner_stop)
    # no --recipe or --template: the prompts the model was trained with (an exported SPICE model records
    # them), else plain
    settings = EvalSettings(max_tokens=args.max_tokens, sample_temperature=args.sample_temperature, seed=args.seed,
                            template=template or "", prompt_dir=prompt_dir, stop=stop)
    judge = None
    if args.judge_engines:  # off by default: the paper's table uses a judge model, the rules are the baseline
        from spice_megatron.eval.harness import LLMJudge
        from spice_megatron.rollout.fleet import RolloutFleet

        tokenizer = None
        if args.judge_tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.judge_tokenizer)
        from spice_megatron.wire.auth import read_token

        judge = LLMJudge(RolloutFleet(args.judge_engines.split(","), read_token()), tokenizer)
    try:
        report, paths = run_evaluation(args.model, names, args.output, args.data, args.benchmark_source,
                                       args.limit or None, settings,
                                       engines=args.engines.split(",") if args.engines else None,
                                       judge=judge, kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    print(markdown_table(report))
    print(f"written: {paths['markdown']}, {paths['json']}, per-item records {paths['items']}")
    return 0


def _run_file(run: str, name: str) -> str:
    """RUN/name for a run directory, else `run` itself, which must exist."""
    path = os.path.join(run, name) if os.path.isdir(run) else run
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file (give a run directory or its {name})")
    return path


def cmd_curves(args: argparse.Namespace) -> int:
    """Training curves of a run (metrics.jsonl) as a PNG."""
    from spice_megatron.eval.analysis import plot_training_curves

    path = _run_file(args.run, "metrics.jsonl")
    out = args.output or os.path.join(os.path.dirname(path), "training_curves.png")
    try:
        print(f"written: {plot_training_curves(path, out)}")
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    return 0


def cmd_coevolution(args: argparse.Namespace) -> int:
    """Paper fig. 3 for a list of HF checkpoints on a fixed pool of documents."""
    from transformers import AutoTokenizer

    from recipes import resolve_recipe
    from spice_megatron.config import SourceConfig
    from spice_megatron.eval.analysis import coevolution, fixed_documents

    checkpoints = [c for c in args.checkpoints.split(",") if c]
    missing = [c for c in checkpoints if not os.path.exists(os.path.join(c, "config.json"))]
    if len(checkpoints) < 2 or missing:
        raise UserError(f"--checkpoints needs at least two HF directories; without config.json: {missing}")
    cfg = resolve_recipe(args.recipe, args.overrides)
    # the recipe's training corpus (staged for a paper recipe), documents as long as in training
    corpus_cfg = cfg.corpus
    if args.source:
        corpus_cfg.sources = [SourceConfig(path=p) for p in args.source]
    if args.max_doc_tokens:
        corpus_cfg.max_doc_tokens = args.max_doc_tokens
    corpus_cfg.max_docs = max(args.documents * 4, 100)
    max_model_len = args.max_model_len or cfg.rollout.max_model_len
    from spice_megatron.data import offline_data

    offline_data.prepare_for(corpus_cfg.sources)  # the demo's local files, as `spice train` makes them
    docs = fixed_documents(corpus_cfg, AutoTokenizer.from_pretrained(checkpoints[0]), args.documents, args.seed,
                           args.recipe)
    result = coevolution(checkpoints, docs, cfg.selfplay, args.output, args.fixed_reasoner, args.fixed_challenger,
                         args.seed, args.kv_cache_gib, max_model_len, args.attempts)
    for key in ("fixed_reasoner_vs_challengers", "reasoners_vs_fixed_challenger"):
        print(key)
        for r in result[key]:
            print(f"  {r['checkpoint']}: {r['correct']}/{r['answers']} correct on {r['tasks']} tasks")
    print(f"written: {args.output}/coevolution.json, {result['png']}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Print audit records of a run, filtered; each traces to its document and weights version. A
    valid challenger task is shown with its document and the reasoner's answers (--full: raw JSON)."""
    from spice_megatron.run.audit import (
        IterationIndex,
        counted_from_one,
        iterations,
        leaks,
        one_line,
        task_block,
        with_document_texts,
    )
    from spice_megatron.run.log import read_jsonl

    path = _run_file(args.run, "audit.jsonl")
    shown, seen_iterations, seen_kinds, seen_versions, seen_docs = 0, set(), set(), set(), set()
    for group in iterations(with_document_texts(counted_from_one(read_jsonl(path)))):
        indexed = IterationIndex(group)
        for k, r in enumerate(group):
            seen_iterations.add(r.get("iteration"))
            seen_kinds.add(r.get("kind"))
            seen_versions.add(r.get("rollout_version"))
            seen_docs.add(r.get("doc_id"))
            if ((args.kind and r.get("kind") != args.kind) or (args.doc and r.get("doc_id") != args.doc)
                    or (args.iteration is not None and r.get("iteration") != args.iteration)
                    or (args.version is not None and r.get("rollout_version") != args.version)
                    or (args.valid and not r.get("valid")) or (args.trained and not r.get("trained"))
                    or (args.leaks and not (r.get("valid") and leaks(r)))):
                continue
            if args.full:
                print(json.dumps(r, ensure_ascii=False))
            elif r.get("kind") == "reasoner" and _shown_in_task_block(r, group, args):
                continue
            elif r.get("kind") == "challenger" and r.get("valid"):
                print(task_block(k, indexed))
            else:
                print(one_line(r))
            shown += 1
            if args.limit and shown >= args.limit:
                return 0
    unknown = []
    if args.iteration is not None and args.iteration not in seen_iterations:
        unknown.append(f"--iteration {args.iteration} (this run's audit has iterations {_span(seen_iterations)})")
    if args.kind and args.kind not in seen_kinds:
        unknown.append(f"--kind {args.kind} (this run's records are "
                       f"{', '.join(sorted(map(str, seen_kinds))) or 'none'})")
    if args.version is not None and args.version not in seen_versions:
        unknown.append(f"--version {args.version} (this run's records were generated by policy versions "
                       f"{_span(seen_versions)})")
    if args.doc and args.doc not in seen_docs:
        unknown.append(f"--doc {args.doc} (no record of this run names it; `spice audit RUN --kind challenger` lists "
                       "the documents)")
    if unknown:
        print(f"no record matches: {'; '.join(unknown)}", file=sys.stderr)
        return 1
    if not shown:  # every filter names something the run has, and together they match nothing
        print("no record matches these filters together", file=sys.stderr)
        return 1
    return 0


def _span(values: set) -> str:
    numbers = sorted(v for v in values if isinstance(v, int))
    return f"{numbers[0]}-{numbers[-1]}" if numbers else "none"


def _shown_in_task_block(answer: dict, group: list[dict], args: argparse.Namespace) -> bool:
    """A reasoner answer already printed inside its task's block (same filters, --kind not set)."""
    k = answer.get("challenger_record")
    if args.kind or not isinstance(k, int) or not 0 <= k < len(group):
        return False
    task = group[k]
    return task.get("kind") == "challenger" and bool(task.get("valid")) and (task.get("trained") or not args.trained)
