"""RLVE-Gym's ~400 adaptive verifiable problem generators (the `rlve-gym` package, imported as `Gym`).

Each RLVE environment is a generator class with a difficulty controller: level d is the controller's
parameter list after d calls of `update()`; a problem is generated from (seed, one parameter of that
list), and its whole state (seed, parameters including the reference answer, passing threshold) is a
JSON-able config that a fresh instance scores from. Upstream scores in [-1, 1]; this environment is
binary: reward 1 iff the environment's own score reaches its `passing_reward_threshold` (what RLVE
counts as accuracy), else 0.

Options: `environments` — RLVE environment names, or "all" (every environment except `HELD_OUT`, RLVE's
50 held-out evaluation environments, and `EXCLUDED`, the environments that failed the sweep of
bench/rlve_gym_generation.py, each with its reason; naming one of those explicitly is allowed; never
`UNSAFE`, whose scorers execute the model's answer as code); `answer_format` —
"plain" (the answer section after `</think>`, narrowed to its last `\\boxed{}` like zrl's other
environments; a section holding RLVE's `<answer></answer>` markers is scored as written) or
"answer_tags" (RLVE's own `<answer>...</answer>` markers, after `</think>`); `levels` —
starting level per environment name (default 0), used when `sample` gets no difficulty; a difficulty
passed to `sample` is the level for every environment it draws, or a mapping name -> level that also
restricts the draw to those names (adaptive difficulty keeps one scheduler per RLVE environment:
`curriculum_tasks()`); `generation_time_limit_s` and
`verify_time_limit_s` — wall-clock limits of one generation and one scoring.

Invariants:
- Generation and scoring run in a child process (`_Worker`), never in the caller: upstream generators
  seed the global `random`/NumPy/torch state, some run long at high levels, and some scorers `eval` or
  `sympify` model output (which can run forever). A call past its limit kills the child (a fresh one
  is forked on the next call); beyond the limit the caller only ever waits for a fresh child to start
  (bench/results/rlve_gym_generation.md measures it). The children are forked
  from a multiprocessing forkserver, which imports the main module of the calling process as
  `__mp_main__`: a script using this environment needs the usual `if __name__ == "__main__":` guard
  (zrl's CLI, pytest and Ray's worker processes have one).
- A generation that fails or times out is skipped and counted, and another problem is drawn;
  `sample` raises only after `_MAX_CONSECUTIVE_FAILURES` failures in a row (a broken option, not bad luck).
- `verify` never raises: a scorer exception or timeout is reward 0, counted, with metadata reason.
- `sample` is deterministic in (n, seed, split, difficulty): each draw's environment, parameter and
  generator seed come from a generator keyed by (seed, split, index, attempt); the child is the only
  place global random state is touched. `split="eval"` keeps problems whose text is in the held-out bucket.
- No scorer that executes the answer as code is ever called (`UNSAFE`); Countdown's `eval` is safe (its
  scorer first requires the answer to hold only digits, operators, brackets and spaces), only slow.
- Counters (`metrics()`): generation failures, generation timeouts, scorer errors, scorer timeouts.
"""

import difflib
import importlib
import math
import multiprocessing
import random
import threading
from collections.abc import Mapping

from zrl.env.base import THINK_END, Environment, extract_answer, in_split
from zrl.types import Message, Prompt, Split, Verification

# RLVE's held-out evaluation environments (upstream data/HELD-OUT_ENVIRONMENTS/test.json): never trained on
# by default, so a run can still be evaluated on unseen environments.
HELD_OUT = frozenset({
    "BAJBytecomputer", "BannedPointSupersetPathCounting", "BanyanHeart", "CRT", "Canon",
    "CirculatingDecimalCounting", "Clique_IndependentSet_Partitioning_Counting", "ConvexHull", "CountdownClose",
    "CowDanceShow", "DoubleStackSorting", "DynDynamite", "EvenDegreeGraphPartitioning",
    "Expression_AddingParenthese_Counting", "FactorialTrailingZeroCount", "FixedModK_Selection_Counting",
    "FutoshikiPuzzle", "GraMinimaGame", "GridTriangleCounting", "HalvingChainCounting", "ImpParty",
    "IntegerFactorizationCounting", "JugPuzzle", "LandAcquisition", "LandformGenerationCounting", "MakingGrade",
    "MatrixPermutation_BothDiagonalOne", "Matrix_BinaryExponentiation", "MaxXorSet", "Maximum_IndependentSet_Tree",
    "MinimumSpanningTree", "Minimum_DominatingInterval", "MostComponentTreeRemovingTwoPaths", "NextPalindromic",
    "PalindromePartitionCounting", "PipelineArrangement", "PolynomialInterpolation", "PrefixConcatenation",
    "PythagoreanGraph_IndependentSetCounting", "SetSplitting", "SkyscraperPuzzle", "SmallestBinaryMultiple",
    "StoneIntervalsGame", "SubgraphIsomorphism", "SubmatrixSumDivisibleCounting", "SubsetSumSequence",
    "SumProductDivisorNum", "SumXorDivisorNum", "Sum_DivisorNum", "TopologicalSort_MinimalLexicographicalOrder",
})

# Environments that failed bench/rlve_gym_generation.py at some level 0..3 (their reference answer, in
# zrl's answer format, did not score 1, or no wrong answer tried scored 0); reason per name.
EXCLUDED: Mapping[str, str] = {
    "PolyaModel": "upstream scorer calls `_process` instead of `processor`, so answer markers are never "
                  "stripped and the reference answer scores 0",
    "MinimumChromaticNumber_SegmentOverlap": "no wrong answer the sweep tried scored 0 (an all-distinct "
                                             "colouring is accepted at level 0); not shown verifiable",
    "MinimumHarmoniousChromaticNumber": "no wrong answer the sweep tried scored 0 (an all-distinct "
                                        "colouring is accepted at level 3); not shown verifiable",
}

# Environments whose scorer runs the model's answer as code: never drawn, and refused when named.
# (`sympy.sympify` evaluates its input as Python, so `__import__('os').system(...)` as an answer would
# run on the verifying host; the scorer's child process limits time, it is not a sandbox.)
UNSAFE: Mapping[str, str] = {
    name: "its scorer passes the answer to sympy.sympify, which executes Python: a model's answer could run "
          "arbitrary code on the verifying host"
    for name in ("Differentiate", "Integral")
}

ANSWER_FORMATS = ("plain", "answer_tags")
_MARKERS = ("<answer>", "</answer>")  # RLVE's default answer markers
_INSTRUCTIONS = {
    "plain": "Reason inside <think></think>, then give only the final answer.",
    "answer_tags": "Reason inside <think></think>, then give the final answer inside <answer></answer>.",
}
_MAX_CONSECUTIVE_FAILURES = 20
_START_METHOD = "forkserver"     # forks from a server that imported Gym once: a replacement child is cheap
_STARTUP_TIMEOUT_S = 300.0       # importing Gym (and torch) in a child that was not preloaded
_EPS = 1e-6                      # RLVE's own tolerance on the passing threshold


def controllers():
    """RLVE's name → difficulty-controller class (imports no generator, no torch)."""
    from Gym.parameter_controllers import identifier2controller
    return identifier2controller


def parameter_list(name: str, level: int) -> list[dict]:
    """The parameters RLVE generates level `level` of `name` from: the controller after `level` updates."""
    controller = controllers()[name]()
    for _ in range(level):
        controller.update()
    return controller.get_parameter_list()


def reference_answer(config: Mapping) -> str | None:
    """The problem's stored reference answer as text, or None (optimisation problems store only the
    optimal value, `gold_answer`, not a solution)."""
    answer = config["parameter"].get("reference_answer")
    return None if answer is None else str(answer)


def format_answer(answer: str, answer_format: str) -> str:
    """`answer` written as a model's response in `answer_format` (empty reasoning section)."""
    body = f"{_MARKERS[0]}{answer}{_MARKERS[1]}" if answer_format == "answer_tags" else answer
    return f"{THINK_END}\n{body}"


# -- child process side -------------------------------------------------------------------------------

def _generate(name: str, parameter: dict, seed: int) -> tuple[str, dict] | None:
    """(prompt text, config) of one RLVE problem, or None when the generator reports failure."""
    from Gym.environments import identifier2environment
    problem = identifier2environment[name]()
    # Upstream's own limit abandons a thread; ours (the caller killing this process) is the real one.
    if not problem.generator(seed=seed, parameter=parameter, timeout_second=10**6):
        return None
    return problem.prompt_generator(), problem.get_config()


def _score(name: str, config: dict, output: str) -> tuple[float, float]:
    """(score, passing threshold) of `output` (RLVE answer-marker form) for the problem `config`."""
    from Gym.environments import identifier2environment
    problem = identifier2environment[name]()
    problem.set_config(config)
    return float(problem.scorer(output)), float(problem.passing_reward_threshold)


def _serve(conn) -> None:
    """Child loop: answer ("generate" | "score", args) requests with ("ok", result) or ("error", text)."""
    importlib.import_module("Gym.environments")  # before "ready", so no request pays for the import
    conn.send(("ready", None))
    handlers = {"generate": _generate, "score": _score}
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", handlers[op](*args)))
        except Exception as exc:  # an upstream generator or scorer raising is an answer, not a crash
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:500]))


class WorkerTimeout(TimeoutError):
    pass


class _Worker:
    """One child process serving requests one at a time; a request past its limit kills the child."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process = None
        self._conn = None

    def call(self, op: str, args: tuple, time_limit_s: float):
        """("ok", result) or ("error", text); raises WorkerTimeout after `time_limit_s`."""
        with self._lock:
            if self._process is None:
                self._start()
            self._conn.send((op, args))
            if not self._conn.poll(time_limit_s):
                self.close()
                raise WorkerTimeout(f"{op} ran past {time_limit_s} s")
            try:
                return self._conn.recv()
            except EOFError:  # the child died (out of memory, a crash in native code)
                self.close()
                return "error", "worker process died"

    def _start(self) -> None:
        ctx = multiprocessing.get_context(_START_METHOD)
        if _START_METHOD == "forkserver":
            ctx.set_forkserver_preload(["Gym.environments"])
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child,), daemon=True, name="rlve-gym-worker")
        self._process.start()
        child.close()
        self._conn = parent
        try:
            ready = parent.poll(_STARTUP_TIMEOUT_S) and parent.recv()[0] == "ready"
        except EOFError:  # the child died while starting (e.g. a script without a `__main__` guard)
            ready = False
        if not ready:
            self.close()
            raise RuntimeError(f"rlve_gym worker process did not start within {_STARTUP_TIMEOUT_S} s")

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._conn.close()
        self._process = self._conn = None


class RlveGym(Environment):
    name = "rlve_gym"
    description = "RLVE-Gym's ~400 adaptive verifiable problem generators, scored by their own checkers"
    reward_type = "binary"
    difficulty_levels = (0, 50)  # controller updates; RLVE's controllers keep growing the parameters

    def __init__(self, environments: str | list[str] = "all", answer_format: str = "plain",
                 levels: Mapping[str, int] | None = None, generation_time_limit_s: float = 5.0,
                 verify_time_limit_s: float = 5.0):
        known = controllers()
        if environments == "all":
            self.environments = sorted(set(known) - HELD_OUT - set(EXCLUDED) - set(UNSAFE))
        elif isinstance(environments, (list, tuple)) and environments and all(isinstance(e, str) for e in environments):
            for name in environments:
                _check_name(name, known, "environments")
                if name in UNSAFE:
                    raise ValueError(f"environments: {name!r} cannot be used: {UNSAFE[name]}")
            self.environments = sorted(set(environments))
        else:
            raise ValueError(f'environments must be "all" or a non-empty list of RLVE names; got {environments!r}')
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}; got {answer_format!r}")
        self.levels = dict(levels or {})
        for name, level in self.levels.items():
            _check_name(name, known, "levels")
            if isinstance(level, bool) or not isinstance(level, int) or level < 0:
                raise ValueError(f"levels[{name!r}] must be an integer >= 0; got {level!r}")
        for field, value in (("generation_time_limit_s", generation_time_limit_s),
                             ("verify_time_limit_s", verify_time_limit_s)):
            if not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{field} must be a positive number of seconds; got {value!r}")
        self.answer_format = answer_format
        self.generation_time_limit_s = float(generation_time_limit_s)
        self.verify_time_limit_s = float(verify_time_limit_s)
        self._generator, self._scorer = _Worker(), _Worker()  # a slow generation never delays scoring
        self._counts = dict.fromkeys(("generation_failures", "generation_timeouts", "scorer_errors",
                                      "scorer_timeouts"), 0)
        self._counts_lock = threading.Lock()

    def curriculum_tasks(self) -> tuple[str, ...]:
        return tuple(self.environments)

    def level(self, name: str, difficulty: float | Mapping[str, int] | None) -> int:
        """The level drawn for `name`: `difficulty` when given (an integer >= 0, or `name`'s entry of a
        mapping), else its starting level."""
        if difficulty is None:
            return self.levels.get(name, 0)
        if isinstance(difficulty, Mapping):
            difficulty = difficulty[name]
        if not float(difficulty).is_integer() or difficulty < 0:
            raise ValueError(f"difficulty must be an integer level >= 0; got {difficulty!r}")
        return int(difficulty)

    def sample(self, n: int, seed: int, split: Split = "train",
               difficulty: float | Mapping[str, int] | None = None) -> list[Prompt]:
        names = self.environments
        if isinstance(difficulty, Mapping):
            unknown = sorted(set(difficulty) - set(self.environments))
            if unknown or not difficulty:
                raise ValueError(f"difficulty: names {unknown} are not among this entry's environments"
                                 if unknown else "difficulty: an empty mapping names no environment")
            names = sorted(difficulty)
        prompts, failures_in_a_row, attempt = [], 0, 0
        while len(prompts) < n:
            rng = random.Random(f"{self.name}:{seed}:{split}:{len(prompts)}:{attempt}")
            attempt += 1
            name = rng.choice(names)
            level = self.level(name, difficulty)
            prompt = self.problem(name, level, rng, split, f"{seed}:{len(prompts)}")
            if prompt is None:
                failures_in_a_row += 1
                if failures_in_a_row >= _MAX_CONSECUTIVE_FAILURES:
                    raise RuntimeError(f"rlve_gym: {failures_in_a_row} generations in a row failed or timed out "
                                       f"(last: {name} at level {level}); see metrics()")
                continue
            failures_in_a_row = 0
            if in_split(prompt.messages[0].content, split):
                prompts.append(prompt)
        return prompts

    def problem(self, name: str, level: int, rng: random.Random, split: Split = "train",
                index: str = "0") -> Prompt | None:
        """One problem of RLVE environment `name` at `level` (parameter and generator seed drawn from `rng`),
        or None when its generation failed or timed out (counted in `metrics()`)."""
        parameter = rng.choice(parameter_list(name, level))
        generated = self.generate(name, parameter, rng.randrange(2**31))
        if generated is None:
            return None
        text, config = generated
        return Prompt(
            env=self.name, prompt_id=f"{self.name}:{split}:{index}",
            messages=(Message("user", f"{text}\n\n{_INSTRUCTIONS[self.answer_format]}"),),
            answer=reference_answer(config) or "", data_source=f"{self.name}:{name}", difficulty=level,
            payload={"environment": name, "config": config})

    def generate(self, name: str, parameter: dict, seed: int) -> tuple[str, dict] | None:
        """(prompt text, config) of one problem, or None (counted) when it failed or timed out."""
        try:
            status, result = self._generator.call("generate", (name, parameter, seed), self.generation_time_limit_s)
        except WorkerTimeout:
            self._count("generation_timeouts")
            return None
        if status != "ok" or result is None:
            self._count("generation_failures")
            return None
        return result

    def verify(self, prompt: Prompt, response: str) -> Verification:
        section = response.rsplit(THINK_END, 1)[-1]
        if self.answer_format == "answer_tags" or all(marker in section for marker in _MARKERS):
            output = section  # RLVE's own markers (also accepted in "plain": RLVE-trained models write them)
        else:
            output = f"{_MARKERS[0]}{extract_answer(response)}{_MARKERS[1]}"
        if not output.replace(_MARKERS[0], "").replace(_MARKERS[1], "").strip():
            return Verification(reward=0.0, metadata={"reason": "no answer"})
        try:
            status, result = self._scorer.call(
                "score", (prompt.payload["environment"], prompt.payload["config"], output), self.verify_time_limit_s)
        except WorkerTimeout:
            self._count("scorer_timeouts")
            return Verification(reward=0.0, metadata={"reason": "scorer timeout"})
        if status != "ok" or not math.isfinite(result[0]):
            self._count("scorer_errors")
            return Verification(reward=0.0, metadata={"reason": "scorer error", "detail": str(result)[:200]})
        score, threshold = result
        passed = score >= threshold - _EPS
        return Verification(reward=float(passed), metadata={"reason": "passed" if passed else "wrong", "score": score})

    def demonstration(self, prompt: Prompt) -> str | None:
        return format_answer(prompt.answer, self.answer_format) if prompt.answer else None

    def metrics(self) -> dict[str, float]:
        """Counts since construction: generation failures/timeouts (skipped problems), scorer errors/timeouts."""
        with self._counts_lock:
            return {key: float(value) for key, value in self._counts.items()}

    def close(self) -> None:
        """Stop the child processes (they are daemons, so they also end with this process)."""
        self._generator.close()
        self._scorer.close()

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self._counts[key] += 1


def _check_name(name: str, known, field: str) -> None:
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=3)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ValueError(f"{field}: unknown RLVE environment {name!r}{hint}")
