"""`spice train`: a recipe's config and overrides, the one-machine conveniences before torchrun
(one-line refusals, offline data, the relaunch), then the trainer; its exit codes and summary."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from spice_megatron.data.offline_data import DEFAULT_OUT
from spice_megatron.entry import UserError

CONFIG_RECORDED_ENV = "SPICE_CONFIG_RECORDED"
# `spice train`'s options that shape a run but are no config field, with their defaults (cli.py's): recorded
# in RUN/config.json, and a resume takes the run's where its command line leaves one at its default (a run
# started with evaluations goes on with them; `spice train --resume --output RUN` alone continues it)
RUN_OPTIONS = {"corpus": None, "general_corpus": "", "eval_benchmarks": "", "eval_limit": 0, "data": DEFAULT_OUT,
               "eval_challenger_docs": ""}


def cmd_train(args: argparse.Namespace) -> int:
    """Run SPICE: the recipe's config, overridden by key=value pairs."""
    from recipes import DEFAULT_RECIPE, resolve_recipe
    from spice_megatron.run.config_file import record_run_config
    from spice_megatron.torchrun import global_rank, relaunch_with_torchrun, rollout_urls_from_env, under_launcher

    resuming = args.resume or args.resume_after_kill_switch
    checking = not under_launcher() or (global_rank() == 0 and not os.environ.get(CONFIG_RECORDED_ENV))
    if resuming and args.output and args.recipe is None:  # the run's own recipe and overrides, then the new ones
        from spice_megatron.run.config_file import recorded_run

        if recorded := recorded_run(args.output):
            args.recipe, args.overrides = recorded["recipe"], [*recorded["overrides"], *args.overrides]
            _take_the_runs_options(args, recorded.get("options") or {}, say=checking)
    args.recipe = args.recipe or DEFAULT_RECIPE
    cfg = resolve_recipe(args.recipe, args.overrides, args.general_corpus)
    if args.output:
        cfg.run.output_dir = args.output
    if args.model:
        cfg.run.model = args.model
    if args.corpus:
        from spice_megatron.config import SourceConfig

        cfg.corpus.sources = [SourceConfig(path=p) for p in args.corpus]
    from spice_megatron.data.corpus import resolve_sources

    resolve_sources(cfg.corpus, args.recipe)  # before any rank starts: a missing staging step is named at once
    if args.resume and not args.resume_after_kill_switch:  # a requeue's refusal comes before any other
        from spice_megatron.run.control import kill_switch_refusal

        refusal = kill_switch_refusal(cfg.run.output_dir, not under_launcher() or global_rank() == 0)
        if refusal:
            print(f"kill switch: {refusal}", file=sys.stderr)
            return 3
    if checking:  # before any model or data is loaded: one run per run directory, a resume the run's config
        from spice_megatron.run.config_file import refuse_changed_config, run_held

        if resuming:
            refuse_changed_config(cfg, args.force_config)
        elif held := run_held(cfg.run.output_dir):
            raise UserError(f"{cfg.run.output_dir} holds a run ({held}); nothing was touched: --resume to continue "
                            "it, or another --output (or remove that directory) to start a new one")
    if not cfg.rollout.engines:  # a cluster launcher started the engines and exported their hosts
        cfg.rollout.engines = rollout_urls_from_env()
    if not under_launcher():  # one-machine conveniences, done once before any rank starts
        _check_before_the_start(cfg, args.recipe)
        print(record_run_config(cfg, args.recipe, args.overrides, resuming, args.force_config, _run_options(args)),
              flush=True)
        os.environ[CONFIG_RECORDED_ENV] = "1"  # the ranks it starts do not record it again
        argv = list(sys.argv[1:])
        if "--model" not in argv:
            argv += ["--model", cfg.run.model]
        p = cfg.parallel  # one data-parallel replica: its TP x PP x CP ranks
        relaunch_with_torchrun(p.tensor_parallel * p.pipeline_parallel * p.context_parallel, [sys.argv[0], *argv])
    elif global_rank() == 0 and not os.environ.get(CONFIG_RECORDED_ENV):  # ranks a cluster launcher started
        from spice_megatron.run_dir import prepare_run_dir

        # the run directory checked before anything is written into it (docs/cluster.md, "A run
        # directory nobody else writes")
        prepare_run_dir(cfg.run.output_dir, cfg.run.group_readable)
        print(record_run_config(cfg, args.recipe, args.overrides, resuming, args.force_config, _run_options(args)),
              flush=True)
    from spice_megatron.loop.driver import EnginesLost, KillSwitch
    from spice_megatron.policy.checkpoint import NoUsableCheckpoint
    from spice_megatron.run.control import Interrupted
    from spice_megatron.trainer import train

    try:
        eval_hook = _eval_hook(args, cfg)
    except (OSError, ValueError) as e:
        raise UserError(f"--eval-challenger-docs: {e}") from None
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
    except NoUsableCheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if summary and global_rank() == 0:
        from spice_megatron.eval.run import held_out_change
        from spice_megatron.metric_names import SUMMARY

        print("\nSPICE run finished: " + cfg.run.output_dir)
        for k in SUMMARY:
            if isinstance(summary.get(k), (int, float)):
                print(f"  {k:28s} {shown(summary[k])}")
        print(f"  metrics: {cfg.run.output_dir}/metrics.jsonl, TensorBoard: {cfg.run.output_dir}/tensorboard, "
              f"audit: {cfg.run.output_dir}/audit.jsonl, HF checkpoint: {cfg.run.output_dir}/hf_final")
        print(f"  plots: spice curves {cfg.run.output_dir}; evaluation: spice eval --model {cfg.run.output_dir}")
        print(_moved_line(os.path.join(cfg.run.output_dir, "metrics.jsonl")))
        held_out = held_out_change(os.path.join(cfg.run.output_dir, "eval"))
        print("\n".join(held_out) or "  held-out accuracy: not measured (--eval-benchmarks, run.eval_every)")
        print("  (the rates above move with the documents drawn more than with training: they show that the loop "
              "runs; held-out accuracy, on questions no training document states, is what shows learning)")
        print("  what each metric means: docs/metrics.md")
        from spice_megatron.run.clean import footprint_line

        print(footprint_line(cfg.run.output_dir))
        print("  evidence of learning: tools/checks/learning_check.py --selfplay (both roles against a frozen control) "
              "and tools/checks/learning_check.py (the reasoner on fixed tasks); docs/learning.md")
    return 0


def _check_before_the_start(cfg, recipe: str) -> None:
    """The run directory, the model, the layout, the context and the data, each a one-line refusal here,
    before torchrun, Megatron and the engines start. A start refused leaves no run directory it made."""
    from spice_megatron.data import offline_data
    from spice_megatron.run.lock import check_unlocked
    from spice_megatron.run_dir import prepare_run_dir

    made = not os.path.lexists(cfg.run.output_dir)
    try:
        prepare_run_dir(cfg.run.output_dir, cfg.run.group_readable)  # private, or one line before torchrun
        check_unlocked(cfg.run.output_dir)  # rank 0 takes the lock; this names a live holder before anything starts
        if not cfg.run.model:
            from spice_megatron.data.offline_assets import default_cpu_model

            cfg.run.model = default_cpu_model(recipe)
        cfg.validate()
        check_model_and_layout(cfg)
        from transformers import AutoTokenizer

        from spice_megatron.selfplay.context_budget import check_context_budget_once

        check_context_budget_once(cfg, AutoTokenizer.from_pretrained(cfg.run.model))
        offline_data.prepare_for(cfg.corpus.sources)
    except BaseException:
        if made and os.path.isdir(cfg.run.output_dir) and not os.listdir(cfg.run.output_dir):
            os.rmdir(cfg.run.output_dir)
        raise


def check_model_and_layout(cfg) -> None:
    """A local model directory's files and the learner's layout against its dimensions, and the
    engines' directory (one the weight sync can fill). A hub id is left to the download, which
    names what it cannot fetch."""
    from spice_megatron.bridge.dequantize import check_engine_model
    from spice_megatron.bridge.preflight import check_hf_model, check_layout, looks_like_local_path

    if cfg.rollout.model and looks_like_local_path(cfg.run.model):
        served, trained = check_hf_model(cfg.rollout.model, "rollout.model"), check_hf_model(cfg.run.model, "run.model")
        if dataclasses.replace(served, hf_config={}) != dataclasses.replace(trained, hf_config={}):
            raise UserError(f"rollout.model={cfg.rollout.model}: not the architecture of run.model={cfg.run.model} "
                            "(the engines must serve a copy of the learner's model)")
    if not cfg.rollout.engines:
        check_engine_model(cfg.engine_model, "rollout.model" if cfg.rollout.model else "run.model")
    if not looks_like_local_path(cfg.run.model):
        return
    p = cfg.parallel
    check_layout(check_hf_model(cfg.run.model, "run.model"), p.tensor_parallel, p.pipeline_parallel,
                 p.expert_parallel, p.expert_tensor_parallel, first_stage_layers=p.first_stage_layers,
                 last_stage_layers=p.last_stage_layers, vpp=p.virtual_pipeline)


MOVED = (("valid-task rate", "valid_task_rate"), ("reasoner pass rate", "reasoner/pass_rate"),
         ("challenger task reward", "challenger/task_reward_mean"), ("frontier share", "challenger/frontier_share"))


def shown(value: float) -> str:
    """A metric as a reader wants it: a count as an integer, a small value with its significant digits
    (a log-prob gap of 1.9e-06 is not 0.0000), others to 4 decimals."""
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4f}"


def _moved_line(metrics_path: str) -> str:
    """One line: what moved from the run's first iteration to its last."""
    from spice_megatron.run.log import read_jsonl

    metrics = list(read_jsonl(metrics_path)) if os.path.exists(metrics_path) else []
    metrics = [m for m in metrics if m["iteration"] > 0]  # iteration 0: the base model's evaluation only
    if len(metrics) < 2:
        return "  moved: one iteration only"
    first, last = metrics[0], metrics[-1]
    parts = [f"{label} {first[key]:.2f} -> {last[key]:.2f}" for label, key in MOVED
             if isinstance(first.get(key), (int, float)) and isinstance(last.get(key), (int, float))]
    return f"  moved (iteration {first['iteration']} -> {last['iteration']}): " + ", ".join(parts)


def _run_options(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in RUN_OPTIONS}


def _take_the_runs_options(args: argparse.Namespace, recorded: dict, say: bool) -> None:
    taken = []
    for name, default in RUN_OPTIONS.items():
        if name in recorded and getattr(args, name) == default and recorded[name] != default:
            setattr(args, name, recorded[name])
            taken.append(f"--{name.replace('_', '-')} {recorded[name]}")
    if taken and say:
        print(f"resume: the run's options: {' '.join(taken)}", flush=True)


def _eval_hook(args: argparse.Namespace, cfg):
    """The trainer's evaluation hook on the driver (None without evaluations): the benchmarks
    through the training fleet, then the challenger's tasks on fixed documents."""
    from spice_megatron.torchrun import global_rank

    if not cfg.run.eval_every or global_rank() != 0 or not (args.eval_benchmarks or args.eval_challenger_docs):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.run.model)
    hooks = []
    if args.eval_benchmarks:
        from spice_megatron.eval.benchmarks import benchmark_names
        from spice_megatron.eval.harness import EvalSettings
        from spice_megatron.eval.run import training_eval_hook

        settings = EvalSettings(max_tokens=cfg.selfplay.reasoner_max_tokens, seed=cfg.run.seed,
                                template=cfg.selfplay.template, prompt_dir=cfg.selfplay.prompt_dir,
                                stop=tuple(cfg.selfplay.reasoner_stop))
        hooks.append(training_eval_hook(benchmark_names(args.eval_benchmarks), args.data, tokenizer, settings,
                                        args.eval_limit or None, os.path.join(cfg.run.output_dir, "eval")))
    if args.eval_challenger_docs:
        from spice_megatron.eval.challenger_eval import challenger_eval_hook, read_documents

        # one sampling seed per run seed: a trained run and its control write from the same draws
        hooks.append(challenger_eval_hook(read_documents(args.eval_challenger_docs),
                                          os.path.join(cfg.run.output_dir, "challenger_eval"), tokenizer,
                                          cfg.selfplay, seed=cfg.run.seed, attempts=cfg.selfplay.group_size))

    def hook(iteration: int, fleet) -> dict[str, float]:
        out: dict[str, float] = {}
        for h in hooks:
            out.update(h(iteration, fleet))
        return out

    return hook
