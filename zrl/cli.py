"""The `zrl` command line: run, validate, plan, envs, eval, ttc, export, init-tiny-model.

Entry points stay thin: parsing and printing here, work in the library. A user's mistake (missing
file, bad YAML, unknown field, wrong type, out-of-range value, a bad `--set`, and every problem
zrl.preflight finds before Ray starts) prints one line per problem to stderr,
`zrl: error: <file or option>: <field>: <reason>`, and exits with EXIT_BAD_INPUT, without a traceback.
Everything wrong in the recipe itself (schema, cross-field rules, an unknown environment name, options
an environment rejects) fails `zrl validate` and `zrl run` alike. What is merely absent on this
machine (a model directory, a repo to download, a data file, GPUs: zrl.preflight) is listed by `zrl
validate`, which still succeeds unless --strict; `zrl run` refuses what it cannot fetch. `zrl validate`
prints a one-screen summary (stages, environments, which directory each model path resolves to:
zrl/hub.py); --full adds the resolved recipe. A model path that cannot be had (zrl.hub.ModelPathError)
is one line, whichever command meets it.

Output: a command's result goes to stdout (a table, or one JSON document with --json: validate, envs,
plan, eval, ttc); every log line goes to stderr, vLLM's included (VLLM_LOGGING_STREAM), and only zrl's
own lines carry the `[zrl HH:MM:SS]` prefix.
"""

import argparse
import contextlib
import dataclasses
import faulthandler
import logging
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path

import yaml

from zrl.config import Recipe, RecipeError, load_recipe
from zrl.config.load import yaml_value
from zrl.config.schema import ModelSpec
from zrl.env.registry import UnknownEnvironmentError
from zrl.hub import ModelPathError
from zrl.models import get_family, registered_types
from zrl.cli_output import flat, print_json, table
from zrl.runtime_env import apply_defaults

log = logging.getLogger("zrl")

EXIT_BAD_INPUT = 2


def _error(lines: list[str], code: int = EXIT_BAD_INPUT) -> int:
    for line in lines:
        sys.stderr.write(f"zrl: error: {line}\n")
    return code


def _load(args) -> Recipe:
    return load_recipe(args.recipe, args.set or [])


def _findings_lines(source: str, findings: list[tuple[str, str]]) -> list[str]:
    return [f"{source}: {field}: {reason}" for field, reason in findings]


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _entries(stage) -> list[str]:
    """Each environment entry of `stage` by its key, with the environment's name where the two differ."""
    return [key if key == spec.name else f"{key} ({spec.name})"
            for key, spec in zip(stage.entry_keys(), stage.environments)]


def cmd_validate(args) -> int:
    from zrl.preflight import check

    recipe = _load(args)
    findings = check(recipe)
    absent = findings.missing + findings.pending
    if args.json:
        print_json({
            "recipe": recipe.name, "ok": not findings.problems and not (args.strict and absent),
            "stages": [{"name": s.name, "kind": s.kind, "steps": s.steps, "environments": _entries(s)}
                       for s in recipe.stages],
            "models": dict(findings.models),
            "data": [{"stage": stage, "entry": entry, "file": path, "status": status}
                     for stage, files in findings.data.items() for entry, path, status in files],
            "problems": [{"field": f, "reason": r} for f, r in findings.problems],
            "absent": [{"field": f, "reason": r} for f, r in absent],
            **({"resolved": recipe.model_dump(mode="json")} if args.full else {})})
    if findings.problems:
        return _error(_findings_lines(args.recipe, findings.problems))
    if not args.json:
        sys.stdout.write(_summary(recipe, findings, absent))
        if args.full:
            sys.stdout.write("\nresolved recipe (defaults filled in):\n"
                             + yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    if args.strict and absent:
        return _error([f"{line} (--strict: absent on this machine)" for line in _findings_lines(args.recipe, absent)])
    return 0


def _summary(recipe: Recipe, findings, absent: list[tuple[str, str]]) -> str:
    """`zrl validate`'s one screen: the stages, where each model comes from, the data, what is absent here."""
    out = [f"{recipe.name}: valid, {_plural(len(recipe.stages), 'stage')}, output_dir {recipe.output_dir}\n",
           table(["stage", "kind", "steps", "environments"],
                 [[s.name, s.kind, s.steps, ", ".join(_entries(s))] for s in recipe.stages])]
    out += [f"{item}: {source}\n" for item, source in findings.models]
    files = [[stage, entry, path, status] for stage, rows in findings.data.items() for entry, path, status in rows]
    if files:
        out.append("data files:\n" + table(["stage", "entry", "file", "status"], files))
    if absent:
        out.append(f"absent on this machine ({_plural(len(absent), 'item')}; a run needs them, --strict fails on "
                   "them):\n")
        out += [f"  {item}: {reason}\n" for item, reason in absent]
    else:
        out.append("absent on this machine: nothing\n")
    return "".join(out)


def cmd_envs(args) -> int:
    from zrl.env import registry

    infos = [registry.get(name) for name in registry.names()]
    if args.json:
        print_json([{"name": i.name, "reward_type": i.reward_type, "description": i.description, "source": i.source}
                     for i in infos])
    elif not infos:
        sys.stdout.write("no environments registered (install a package exposing `zrl.environments` "
                         "entry points, or reference `module:Class` in a recipe)\n")
    else:
        sys.stdout.write(table(["name", "reward", "description"],
                               [[i.name, i.reward_type or "-", i.description] for i in infos]))
    return 0


def cmd_init_tiny_model(args) -> int:
    from zrl.assets import is_checkpoint_dir

    target = Path(args.dir)
    if target.exists() and not target.is_dir():
        return _error([f"{args.dir}: exists and is not a directory"])
    if is_checkpoint_dir(target):
        return _error([f"{args.dir}: holds a checkpoint already (config.json, *.safetensors); remove it to rebuild"])
    if target.is_dir() and any(target.iterdir()):
        return _error([f"{args.dir}: directory is not empty; the tiny model is written only into a new or empty one"])
    path = get_family(args.arch).build_tiny(args.dir, seed=args.seed)
    sys.stdout.write(f"tiny {args.arch} checkpoint and tokenizer written to {path}\n")
    return 0


def cmd_run(args) -> int:
    from zrl.preflight import check
    from zrl.run import RunDirectoryError, run_recipe

    if args.address and args.address.startswith(("http://", "https://")):
        return _error([f"--address: {args.address} is a Ray job submission (dashboard) address; submit there with "
                       f"`ray job submit --address {args.address} -- zrl run RECIPE`, or give the cluster's address "
                       "(ray://host:10001, host:6379 or auto)"])
    recipe = _load(args)
    # GPUs are counted here only when the run starts its own Ray on this machine
    findings = check(recipe, gpus_here=not (args.address or os.environ.get("RAY_ADDRESS")))
    if findings.problems or findings.missing:
        return _error(_findings_lines(args.recipe, findings.problems + findings.missing))
    try:
        return run_recipe(recipe, address=args.address, resume=args.resume, command=_run_command(args))
    except RunDirectoryError as exc:
        return _error([str(exc)])


def _run_command(args) -> str:
    """The `zrl run` command line that names this recipe (for the resume hint)."""
    sets = "".join(f" --set {shlex.quote(item)}" for item in args.set or [])
    address = f" --address {shlex.quote(args.address)}" if args.address else ""
    return f"zrl run {shlex.quote(args.recipe)}{sets}{address}"


def _options(text: str | None) -> dict | str:
    """The `--options` mapping of an environment, or the one-line reason it is not one."""
    try:
        options = yaml_value(text) if text else {}
    except yaml.YAMLError:
        return f"--options: not YAML: {text!r}"
    if not isinstance(options, dict):
        return f"--options: expected a mapping such as '{{max_operand: 20}}', got {text!r}"
    return options


def _checkpoint(args) -> Path | str:
    """The local directory of CHECKPOINT (a directory or a Hugging Face repo id: zrl/hub.py), or the
    one-line reason there is none. With --adapter, CHECKPOINT is the adapter's base (default: the base its
    adapter_config.json names)."""
    from zrl.hub import is_hub_id, resolve

    path = args.checkpoint
    if args.adapter is not None and path is None:
        from zrl.adapter_checkpoint import adapter_base

        path = adapter_base(args.adapter)
        if path is None:
            return (f"--adapter: {args.adapter}: its adapter_config.json names no base_model_name_or_path; give the "
                    "base as CHECKPOINT")
    if path is None:
        return "checkpoint: required (or --adapter DIR, whose adapter_config.json names its base)"
    local = resolve(path, args.revision, "checkpoint")
    if not (local / "config.json").is_file():
        snapshot = f" (snapshot {local})" if is_hub_id(path) else ""
        return f"{path}{snapshot}: not a checkpoint directory (no config.json)"
    return local


@contextlib.contextmanager
def _model_dir(args):
    """The checkpoint directory to evaluate (or the one-line reason there is none): CHECKPOINT, or with
    --adapter the adapter merged into its base in a temporary directory, removed afterwards."""
    checkpoint = _checkpoint(args)
    if isinstance(checkpoint, str) or args.adapter is None:
        yield checkpoint
        return
    from zrl.adapter_checkpoint import merge_adapter

    with tempfile.TemporaryDirectory(prefix="zrl-merged-") as tmp:
        yield merge_adapter(args.adapter, checkpoint, Path(tmp) / "hf")


def _environment(name: str) -> str | None:
    """The one-line reason `--env NAME` names no environment (with the closest names), or None."""
    from zrl.env import UnknownEnvironmentError, registry
    from zrl.preflight import unknown_environment

    if ":" in name:
        return None  # a `module:Class` reference: imported, and its errors reported, where it is built
    try:
        registry.get(name)
    except UnknownEnvironmentError as exc:
        return f"--env: {unknown_environment(name, exc)}"
    return None


def cmd_eval(args) -> int:
    from zrl.config.schema import EnvironmentSpec, RewardModelSpec
    from zrl.evaluate import EvalRequest, evaluate_checkpoints

    options = _options(args.options)
    if isinstance(options, str):
        return _error([options])
    unknown = _environment(args.env)
    if unknown:
        return _error([unknown])
    if args.more and args.adapter is not None:
        return _error(["--adapter: one adapter is evaluated at a time; give one CHECKPOINT (its base)"])
    if args.more and args.save_rollouts is not None:
        return _error(["--save-rollouts: writes the rollouts of one checkpoint; give one CHECKPOINT"])
    others = [_checkpoint(argparse.Namespace(**{**vars(args), "checkpoint": more})) for more in args.more]
    bad = [c for c in others if isinstance(c, str)]
    if bad:
        return _error(bad)
    reward_model = None if args.reward_model is None else RewardModelSpec(path=args.reward_model, dtype=args.dtype)
    request = EvalRequest(EnvironmentSpec(name=args.env, options=options), num_prompts=args.num_prompts,
                          samples_per_prompt=args.samples, temperature=args.temperature,
                          max_response_tokens=args.max_response_tokens, split=args.split,
                          save_rollouts=args.save_rollouts)
    try:
        with _model_dir(args) as checkpoint:
            if isinstance(checkpoint, str):
                return _error([checkpoint])
            results = [r for [r] in evaluate_checkpoints([checkpoint, *others], [request], seed=args.seed,
                                                         dtype=args.dtype, reward_model=reward_model)]
    except (ValueError, FileNotFoundError) as exc:  # bad options or adapter, other models, a missing reward model
        return _error([str(exc)])
    rows = [dataclasses.asdict(r) for r in results]
    if args.json:
        print_json(rows if args.more else rows[0])  # one checkpoint: its object, as before several were taken
    else:
        sys.stdout.write("".join(table(["result", "value"], flat(row)) for row in rows))
    return 0


def cmd_ttc(args) -> int:
    from serving.rsa import RSAConfig, evaluate_rsa
    from zrl.config.schema import EnvironmentSpec

    options = _options(args.options)
    if isinstance(options, str):
        return _error([options])
    try:  # the settings first: a bad one is refused before a checkpoint is looked for or downloaded
        config = RSAConfig(num_candidates=args.population, num_aggregated=args.aggregate, num_rounds=args.rounds,
                           thinking_budget=args.thinking_budget, tail_tokens=args.tail_tokens,
                           answer_budget=args.answer_budget, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, hybrid=args.hybrid)
    except ValueError as exc:
        return _error([str(exc)])
    unknown = _environment(args.env)
    if unknown:
        return _error([unknown])
    try:
        with _model_dir(args) as checkpoint:
            if isinstance(checkpoint, str):
                return _error([checkpoint])
            result = evaluate_rsa(checkpoint, EnvironmentSpec(name=args.env, options=options), config,
                                  num_prompts=args.num_prompts, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:  # bad settings, options or adapter: one line
        return _error([str(exc)])
    result.write_jsonl(args.output)
    rounds = [result.round_summary(i) for i in range(config.num_rounds + 1)]
    if args.json:
        print_json({"rounds": rounds, "candidates": args.output})
    else:
        sys.stdout.write(table(list(rounds[0]), [list(r.values()) for r in rounds]) + f"candidates: {args.output}\n")
    return 0


def cmd_export(args) -> int:
    from zrl.checkpoint_export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, model_path=args.model, dtype=args.dtype)
    except ExportError as exc:
        return _error([str(exc)])
    sys.stdout.write(f"Hugging Face checkpoint written to {out}\n")
    return 0


def cmd_plan(args) -> int:
    from zrl.plan.report import (format_point, format_sweep, knee, load_workload, plan_point, plot_sweep,
                                  point_summary, with_recipe_model)

    recipe = _load(args)
    rl_stages = [s.name for s in recipe.stages if s.kind == "rl"]
    stages = [s for s in recipe.stages if s.kind == "rl" and (args.stage is None or s.name == args.stage)]
    if not stages:
        return _error([f"--stage: no RL stage {args.stage!r} in {args.recipe}; its RL stages: "
                       f"{', '.join(rl_stages) or 'none'}" if args.stage
                       else f"{args.recipe}: stages: no RL stage to plan"])
    for name, value in (("--trainer-gpus", args.trainer_gpus), ("--rollout-gpus", args.rollout_gpus), ("--steps", args.steps)):
        if value is not None and value < (2 if name == "--steps" else 1):
            return _error([f"{name}: must be >= {2 if name == '--steps' else 1}, got {value}"])
    try:
        ratios = [float(r) for r in args.sweep.split(",")] if args.sweep else []
    except ValueError:
        return _error([f"--sweep: expected ratios such as 1,2,3,4,5, got {args.sweep!r}"])
    if any(r <= 0 for r in ratios):
        return _error([f"--sweep: ratios must be > 0, got {args.sweep!r}"])
    if not ratios and args.rollout_gpus is None:
        return _error(["--rollout-gpus: required unless --sweep is given"])
    stage, res = stages[0], recipe.resources
    trainer_gpus = args.trainer_gpus or int(res.trainer_workers * (res.gpus_per_trainer_worker or 1))
    steps = args.steps or min(stage.steps, 100)
    try:
        spec = with_recipe_model(load_workload(args.workload), recipe.model.path, recipe.model.revision)

        def point(rollout_gpus: int):
            return plan_point(stage, spec, rollout_gpus=rollout_gpus, trainer_gpus=trainer_gpus,
                              gpus_per_rollout_worker=res.gpus_per_rollout_worker, steps=steps, seed=args.seed)

        if not ratios:
            one = point(args.rollout_gpus)
            if args.json:
                print_json({"recipe": recipe.name, "stage": stage.name, "steps": steps, **point_summary(one)})
            else:
                sys.stdout.write(f"stage {stage.name!r}, {_plural(steps, 'simulated step')}\n{format_point(one)}\n")
            return 0
        points = []
        for ratio in ratios:
            points.append(point(round(ratio * trainer_gpus)))
            log.info("ratio %g:1 simulated", ratio)
    except ValueError as exc:
        return _error([str(exc)])
    plot = plot_sweep(points, args.plot or f"plan-{recipe.name}-{stage.name}.png", f"{recipe.name}: {stage.name}")
    if args.json:
        print_json({"recipe": recipe.name, "stage": stage.name, "steps": steps, "trainer_gpus": trainer_gpus,
                     "knee_ratio": knee(points).ratio, "points": [point_summary(p) for p in points], "plot": str(plot)})
    else:
        sys.stdout.write(f"stage {stage.name!r}, {_plural(steps, 'simulated step')}, trainer {trainer_gpus} GPU(s)\n"
                         f"{format_sweep(points)}\nplot: {plot}\n")
    return 0


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows an option's default where it has one (None and off switches: nothing to show)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import version

    return f"zrl {version('zrl')}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zrl", description="Asynchronous RL post-training for MoE reasoning models.")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, json_output: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=_HelpWithDefaults)
        if json_output:
            p.add_argument("--json", action="store_true", help="the result as one JSON document on stdout (logs "
                                                                "always go to stderr)")
        return p

    def recipe_args(p):
        p.add_argument("recipe", help="cascade recipe (YAML)")
        p.add_argument("--set", action="append", metavar="PATH=VALUE",
                       help="override a field, e.g. --set stages.0.steps=10 (repeatable; value parsed as YAML)")

    p = command("run", "run a cascade recipe (embedded Ray unless --address is given)", json_output=False)
    recipe_args(p)
    p.add_argument("--address", help="Ray cluster address (ray://host:10001, host:6379 or auto); to use a "
                                     "dashboard address http://host:8265, submit with `ray job submit`")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in output_dir from its latest checkpoint (same recipe; resources, "
                        "metrics sinks and checkpoint intervals may change)")
    p.set_defaults(func=cmd_run)

    p = command("validate", "check a recipe (every check short of starting Ray) and summarise it: exit 2 on "
                            "anything wrong in the recipe; what is absent on this machine is listed")
    recipe_args(p)
    p.add_argument("--strict", action="store_true", help="also exit 2 when something the run needs is absent on "
                                                         "this machine (a model, a data file, GPUs)")
    p.add_argument("--full", action="store_true", help="also print the resolved recipe, every default filled in")
    p.set_defaults(func=cmd_validate)

    p = command("plan", "simulate a stage's scheduling on a cluster: steps/hour, idle, staleness, async vs sync")
    recipe_args(p)
    p.add_argument("--rollout-gpus", type=int, help="rollout pool GPUs (workers = GPUs / gpus_per_rollout_worker)")
    p.add_argument("--trainer-gpus", type=int, help="trainer pool GPUs (default: the recipe's)")
    p.add_argument("--sweep", metavar="RATIOS", help="rollout:trainer ratios to sweep, e.g. 1,2,3,4,5; writes a plot")
    p.add_argument("--stage", help="RL stage to plan (default: the first)")
    p.add_argument("--workload", help="workload YAML (zrl.plan.report.WorkloadSpec fields; default: ZAYA1-8B on H100)")
    p.add_argument("--steps", type=int, help="simulated trainer steps (default: the stage's, at most 100)")
    p.add_argument("--seed", type=int, default=0, help="simulation seed")
    p.add_argument("--plot", help="plot path for --sweep (default: plan-<recipe>-<stage>.png)")
    p.set_defaults(func=cmd_plan)

    p = command("envs", "list registered environments")
    p.set_defaults(func=cmd_envs)

    families = ", ".join(registered_types())  # config.json model_types zrl can load (zrl/models)

    def model_args(p):
        p.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter directory (e.g. <output_dir>/stages/"
                                                        "<name>/adapter): evaluated merged into its base, CHECKPOINT "
                                                        "or else the base its adapter_config.json names")
        p.add_argument("--revision", help="branch, tag or commit of a Hub repo id CHECKPOINT (default: main)")
        p.add_argument("--env", required=True, help="environment name or module:Class")
        p.add_argument("--options", help="environment options as YAML, e.g. '{max_operand: 20}'")

    p = command("eval", "accuracy of a checkpoint on an environment's held-out split")
    p.add_argument("checkpoint", nargs="?",
                   help=f"Hugging Face checkpoint of a registered model family ({families}): a directory (e.g. "
                        "<output_dir>/stages/<name>/hf) or a Hub repo id org/name (cached, or downloaded on first "
                        "use); with --adapter, the adapter's base (default: the one it names)")
    p.add_argument("more", nargs="*", metavar="CHECKPOINT",
                   help="more checkpoints of the same model (a run's stage exports), evaluated after the first on "
                        "its engine, each loaded in place: one start for all; --json then prints a list")
    model_args(p)
    p.add_argument("--num-prompts", type=int, default=200, help="problems evaluated")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--max-response-tokens", type=int, default=64, help="generated tokens per sample at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the problems and of sampling")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine dtype")
    p.add_argument("--reward-model", help="reward-model checkpoint directory or Hub repo id, for reward-model "
                                          "environments (scored in this process)")
    p.add_argument("--split", default="eval", choices=["eval", "train"], help="which problems (eval: held-out)")
    p.add_argument("--save-rollouts", metavar="FILE", help="write prompts, responses and rewards as JSONL (the "
                                                           "rollouts file of the `aggregation` environment)")
    p.set_defaults(func=cmd_eval)

    p = command("ttc", "Markovian RSA test-time compute on an environment's held-out split: per-round "
                       "accuracy, candidates to a JSONL")
    p.add_argument("checkpoint", nargs="?",
                   help=f"Hugging Face checkpoint of a registered model family ({families}): a directory or a Hub "
                        "repo id org/name; with --adapter, the adapter's base (default: the one it names)")
    model_args(p)
    p.add_argument("--num-prompts", type=int, default=50, help="problems evaluated")
    p.add_argument("--population", "-N", type=int, default=16, help="N, candidates per problem and round")
    p.add_argument("--aggregate", "-C", type=int, default=4, help="C, candidates per aggregation prompt")
    p.add_argument("--rounds", "-T", type=int, default=2, help="T, aggregation rounds after the first samples")
    p.add_argument("--thinking-budget", type=int, default=256, help="beta, generated tokens per candidate")
    p.add_argument("--tail-tokens", type=int, default=64, help="tau, tokens of a candidate's reasoning tail")
    p.add_argument("--answer-budget", type=int, default=32, help="tokens of a forced answer (0: none)")
    p.add_argument("--hybrid", action="store_true", help="finished candidates forward their answer, not a tail")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--seed", type=int, default=0, help="seed of the problems and of sampling")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine dtype")
    p.add_argument("--output", default="ttc.jsonl", help="JSONL of every candidate")
    p.set_defaults(func=cmd_ttc)

    p = command("export", "write a trainer checkpoint (<output_dir>/checkpoints/step_N) as a Hugging Face "
                          "checkpoint directory, as a stage's export (<output_dir>/stages/<name>/hf)",
                json_output=False)
    p.add_argument("checkpoint", help="trainer checkpoint directory, e.g. <output_dir>/checkpoints/step_000120")
    p.add_argument("out", help="new or empty directory to write")
    p.add_argument("--model", help="the model the run started from, for its config and tokenizer (directory or Hub "
                                   "repo id; default: model.path of the run's recipe.resolved.yaml)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="weights' dtype (default: the run's model.dtype)")
    p.set_defaults(func=cmd_export)

    p = command("init-tiny-model", "build the tiny CPU tokenizer + checkpoint of a registered model_type",
                json_output=False)
    p.add_argument("dir", help="new or empty directory to write (a scratch asset path such as runs/assets/tiny-zaya)")
    p.add_argument("--arch", default=ModelSpec.model_fields["tiny_arch"].default, choices=registered_types(),
                   help="model_type of the tiny checkpoint, as model.tiny_arch")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.set_defaults(func=cmd_init_tiny_model)
    return parser


class _ConsoleFormatter(logging.Formatter):
    """zrl's own lines as `[zrl HH:MM:SS] message`; another library's as `[LEVEL name HH:MM:SS] message`,
    so a vLLM or Ray warning is never mistaken for one of zrl's."""

    def __init__(self):
        super().__init__("[zrl %(asctime)s] %(message)s", datefmt="%H:%M:%S")
        self.other = logging.Formatter("[%(levelname)s %(name)s %(asctime)s] %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record) if record.name.partition(".")[0] == "zrl" else self.other.format(record)


def _configure_logging(verbose: bool) -> None:
    """Every log line to stderr (stdout is the command's result). vLLM configures its own logging on import,
    to stdout unless VLLM_LOGGING_STREAM says otherwise: set before anything imports vLLM."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(_ConsoleFormatter())
    # The console is zrl's own lines; other libraries' loggers only from warnings up (-v: everything).
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[console])
    logging.getLogger("zrl").setLevel(logging.DEBUG if verbose else logging.INFO)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the cascade's cleanup like Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # `kill -USR1 PID`: every thread's stack to the process's stderr (the original one: a caller may have
    # replaced sys.stderr with an object that has no file descriptor)
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    apply_defaults()
    _configure_logging(args.verbose)
    try:
        return args.func(args)
    except RecipeError as exc:
        return _error(str(exc).splitlines())
    except (UnknownEnvironmentError, ModelPathError) as exc:
        return _error([str(exc)])
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, without a checkpoint
        return _error(["interrupted; resume from the latest checkpoint with `zrl run RECIPE --resume`"], 130)


if __name__ == "__main__":
    sys.exit(main())
