"""The `zrl` command line: run, validate, plan, envs, eval, ttc, init-tiny-model.

Entry points stay thin: parsing and printing here, work in the library. A user's mistake (missing
file, bad YAML, unknown field, wrong type, out-of-range value, a bad `--set`, and every problem
zrl.preflight finds before Ray starts) prints one line per problem to stderr,
`zrl: error: <file or option>: <field>: <reason>`, and exits with EXIT_BAD_INPUT, without a traceback.
`zrl validate` notes what the recipe names but this machine lacks (an environment not installed here,
a model directory not present, a Hugging Face repo not cached while offline) and still succeeds; `zrl
run` refuses those too. It also says which directory each model path resolves to (zrl/hub.py). A model
path that cannot be had (zrl.hub.ModelPathError) is one line, whichever command meets it.
"""

import argparse
import faulthandler
import logging
import shlex
import signal
import sys
from pathlib import Path

import yaml

from zrl.config import Recipe, RecipeError, load_recipe
from zrl.config.load import yaml_value
from zrl.env.registry import UnknownEnvironmentError
from zrl.hub import ModelPathError
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


def cmd_validate(args) -> int:
    from zrl.preflight import check

    recipe = _load(args)
    findings = check(recipe)
    if findings.problems:
        return _error(_findings_lines(args.recipe, findings.problems))
    sys.stdout.write(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    sys.stdout.write(f"# schema: OK ({len(recipe.stages)} stages)\n")
    for item, source in findings.models:
        sys.stdout.write(f"# {item}: {source}\n")
    if findings.missing:
        sys.stdout.write(f"# availability: {len(findings.missing)} item(s) not available on this machine:\n")
        for item, problem in findings.missing:
            sys.stdout.write(f"#   {item}: {problem}\n")
    else:
        sys.stdout.write("# availability: every environment and the model are available\n")
    for stage, files in findings.data.items():
        if files:
            sys.stdout.write(f"# data of stage {stage}:\n")
            for entry, path, status in files:
                sys.stdout.write(f"#   {entry}: {path}: {status}\n")
    return 0


def cmd_envs(args) -> int:
    from zrl.env import registry

    names = registry.names()
    if not names:
        sys.stdout.write("no environments registered (install a package exposing `zrl.environments` "
                         "entry points, or reference `module:Class` in a recipe)\n")
    for name in names:
        info = registry.get(name)
        sys.stdout.write(f"{name:24s} {info.reward_type or '-':10s} {info.description}\n")
    return 0


def cmd_init_tiny_model(args) -> int:
    from zrl.assets import build_tiny_model

    path = build_tiny_model(args.dir, seed=args.seed)
    sys.stdout.write(f"tiny zaya checkpoint and tokenizer written to {path}\n")
    return 0


def cmd_run(args) -> int:
    from zrl.preflight import check
    from zrl.run import RunDirectoryError, run_recipe

    recipe = _load(args)
    findings = check(recipe)
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
    one-line reason there is none."""
    from zrl.hub import is_hub_id, resolve

    local = resolve(args.checkpoint, args.revision, "checkpoint")
    if not (local / "config.json").is_file():
        snapshot = f" (snapshot {local})" if is_hub_id(args.checkpoint) else ""
        return f"{args.checkpoint}{snapshot}: not a checkpoint directory (no config.json)"
    return local


def cmd_eval(args) -> int:
    import dataclasses
    import json

    from zrl.config.schema import EnvironmentSpec, RewardModelSpec
    from zrl.evaluate import evaluate

    options = _options(args.options)
    if isinstance(options, str):
        return _error([options])
    checkpoint = _checkpoint(args)
    if isinstance(checkpoint, str):
        return _error([checkpoint])
    reward_model = None if args.reward_model is None else RewardModelSpec(path=args.reward_model, dtype=args.dtype)
    try:
        result = evaluate(checkpoint, EnvironmentSpec(name=args.env, options=options),
                          num_prompts=args.num_prompts, seed=args.seed, samples_per_prompt=args.samples,
                          temperature=args.temperature, max_response_tokens=args.max_response_tokens, dtype=args.dtype,
                          reward_model=reward_model, split=args.split, save_rollouts=args.save_rollouts)
    except (ValueError, FileNotFoundError) as exc:  # bad options, a missing reward model: one line
        return _error([str(exc)])
    sys.stdout.write(json.dumps(dataclasses.asdict(result)) + "\n")
    return 0


def cmd_ttc(args) -> int:
    import json

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
    checkpoint = _checkpoint(args)
    if isinstance(checkpoint, str):
        return _error([checkpoint])
    try:
        result = evaluate_rsa(checkpoint, EnvironmentSpec(name=args.env, options=options), config,
                              num_prompts=args.num_prompts, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:  # bad settings or options: one line
        return _error([str(exc)])
    result.write_jsonl(args.output)
    for round_index in range(config.num_rounds + 1):
        sys.stdout.write(json.dumps(result.round_summary(round_index)) + "\n")
    return 0


def cmd_plan(args) -> int:
    from zrl.plan.report import format_point, format_sweep, load_workload, plan_point, plot_sweep

    recipe = _load(args)
    stages = [s for s in recipe.stages if s.kind == "rl" and (args.stage is None or s.name == args.stage)]
    if not stages:
        return _error([f"--stage: no RL stage {args.stage!r} in {args.recipe}" if args.stage
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
        spec = load_workload(args.workload)

        def point(rollout_gpus: int):
            return plan_point(stage, spec, rollout_gpus=rollout_gpus, trainer_gpus=trainer_gpus,
                              gpus_per_rollout_worker=res.gpus_per_rollout_worker, steps=steps, seed=args.seed)

        if not ratios:
            sys.stdout.write(f"stage {stage.name!r}, {steps} simulated steps\n{format_point(point(args.rollout_gpus))}\n")
            return 0
        points = []
        for ratio in ratios:
            points.append(point(round(ratio * trainer_gpus)))
            log.info("ratio %g:1 simulated", ratio)
    except ValueError as exc:
        return _error([str(exc)])
    sys.stdout.write(f"stage {stage.name!r}, {steps} simulated steps, trainer {trainer_gpus} GPU(s)\n"
                     f"{format_sweep(points)}\n")
    plot = plot_sweep(points, args.plot or f"plan-{recipe.name}-{stage.name}.png", f"{recipe.name}: {stage.name}")
    sys.stdout.write(f"plot: {plot}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zrl", description="Asynchronous RL post-training for MoE reasoning models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def recipe_args(p):
        p.add_argument("recipe", help="cascade recipe (YAML)")
        p.add_argument("--set", action="append", metavar="PATH=VALUE",
                       help="override a field, e.g. --set stages.0.steps=10 (repeatable; value parsed as YAML)")

    p = sub.add_parser("run", help="run a cascade recipe (embedded Ray unless --address is given)")
    recipe_args(p)
    p.add_argument("--address", help="Ray cluster address (ray://host:10001, http://host:8265 or auto)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in output_dir from its latest checkpoint (same recipe; resources, "
                        "metrics sinks and checkpoint intervals may change)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("validate", help="check a recipe and print it resolved with defaults")
    recipe_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="simulate a stage's scheduling on a cluster: steps/hour, idle, staleness, "
                                    "async vs sync")
    recipe_args(p)
    p.add_argument("--rollout-gpus", type=int, help="rollout pool GPUs (workers = GPUs / gpus_per_rollout_worker)")
    p.add_argument("--trainer-gpus", type=int, help="trainer pool GPUs (default: the recipe's)")
    p.add_argument("--sweep", metavar="RATIOS", help="rollout:trainer ratios to sweep, e.g. 1,2,3,4,5; writes a plot")
    p.add_argument("--stage", help="RL stage to plan (default: the first)")
    p.add_argument("--workload", help="workload YAML (zrl.plan.report.WorkloadSpec fields; default: ZAYA1-8B on H100)")
    p.add_argument("--steps", type=int, help="simulated trainer steps (default: the stage's, at most 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="plot path for --sweep (default: plan-<recipe>-<stage>.png)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("envs", help="list registered environments")
    p.set_defaults(func=cmd_envs)

    p = sub.add_parser("eval", help="accuracy of a checkpoint on an environment's held-out split")
    p.add_argument("checkpoint", help="Hugging Face zaya checkpoint: a directory (e.g. <output_dir>/stages/<name>/hf) "
                                      "or a Hub repo id org/name (cached, or downloaded on first use)")
    p.add_argument("--revision", help="branch, tag or commit of a Hub repo id CHECKPOINT (default: main)")
    p.add_argument("--env", required=True, help="environment name or module:Class")
    p.add_argument("--options", help="environment options as YAML, e.g. '{max_operand: 20}'")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-response-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reward-model", help="reward-model checkpoint directory or Hub repo id, for reward-model "
                                          "environments (scored in this process)")
    p.add_argument("--split", default="eval", choices=["eval", "train"], help="which problems (default: held-out)")
    p.add_argument("--save-rollouts", metavar="FILE", help="write prompts, responses and rewards as JSONL (the "
                                                           "rollouts file of the `aggregation` environment)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("ttc", help="Markovian RSA test-time compute on an environment's held-out split: one "
                                   "JSON line per round, candidates to a JSONL")
    p.add_argument("checkpoint", help="Hugging Face zaya checkpoint: a directory or a Hub repo id org/name")
    p.add_argument("--revision", help="branch, tag or commit of a Hub repo id CHECKPOINT (default: main)")
    p.add_argument("--env", required=True, help="environment name or module:Class")
    p.add_argument("--options", help="environment options as YAML, e.g. '{max_operand: 20}'")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--population", "-N", type=int, default=16, help="N, candidates per problem and round")
    p.add_argument("--aggregate", "-C", type=int, default=4, help="C, candidates per aggregation prompt")
    p.add_argument("--rounds", "-T", type=int, default=2, help="T, aggregation rounds after the first samples")
    p.add_argument("--thinking-budget", type=int, default=256, help="beta, generated tokens per candidate")
    p.add_argument("--tail-tokens", type=int, default=64, help="tau, tokens of a candidate's reasoning tail")
    p.add_argument("--answer-budget", type=int, default=32, help="tokens of a forced answer (0: none)")
    p.add_argument("--hybrid", action="store_true", help="finished candidates forward their answer, not a tail")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--output", default="ttc.jsonl", help="JSONL of every candidate (default: ttc.jsonl)")
    p.set_defaults(func=cmd_ttc)

    p = sub.add_parser("init-tiny-model", help="build the tiny CPU tokenizer + zaya checkpoint")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init_tiny_model)
    return parser


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the cascade's cleanup like Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # `kill -USR1 PID`: every thread's stack to the process's stderr (the original one: a caller may have
    # replaced sys.stderr with an object that has no file descriptor)
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    apply_defaults()
    # The console is zrl's own lines; other libraries' loggers only from warnings up (-v: everything).
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="[zrl %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("zrl").setLevel(logging.DEBUG if args.verbose else logging.INFO)
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
