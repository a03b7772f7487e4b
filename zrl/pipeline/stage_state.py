"""An RL stage's data state: what a checkpoint saves beside the weights, and how a stage continues from it.

The data state is the buffer's state (counters, prompt ledger, frontier, staleness histogram), each
rollout worker's state as of its last reported round (its prompt-source position), and the stage's
difficulty schedulers (or an earlier stage's, passed on through a stage without adaptive entries).
Buffered and in-flight groups are not saved: on resume the workers generate fresh groups in their
place (the buffer counts them as discarded_on_resume).
"""

from __future__ import annotations

import logging

import ray

log = logging.getLogger("zrl")


def data_state(stage_name: str, buffer, worker_states: list[dict], curriculum, passed_on: dict | None) -> dict:
    """`curriculum`: the stage's StageCurriculum or None; `passed_on`: an earlier stage's scheduler
    state this stage carries (saved when it has no curriculum of its own)."""
    state = {"stage": stage_name, "buffer": ray.get(buffer.state_dict.remote()), "workers": list(worker_states)}
    if curriculum is not None:
        state["curriculum"] = curriculum.state_dict()
    elif passed_on is not None:
        state["curriculum"] = passed_on
    return state


def restore(stage_name: str, state: dict, buffer, workers: list, worker_states: list[dict], curriculum,
            trainer_step: int) -> dict | None:
    """Load `data_state()` of a checkpoint into the buffer, the curriculum and the workers (and
    `worker_states`, in place). Returns the checkpoint's scheduler state when the stage has no
    curriculum to load it into (to pass on), else None."""
    if state.get("stage") != stage_name:
        raise ValueError(f"stage {stage_name!r}: the checkpoint's data state is of stage {state.get('stage')!r}")
    ray.get(buffer.load_state_dict.remote(state["buffer"]))
    passed_on = None
    if curriculum is not None and "curriculum" in state:
        curriculum.load_state_dict(state["curriculum"])
    elif "curriculum" in state:
        passed_on = state["curriculum"]
    saved = state["workers"]
    if len(saved) != len(workers):
        log.warning("the checkpoint holds the prompt positions of %d rollout worker(s), this run has %d: "
                    "workers without a saved position start their own prompt stream", len(saved), len(workers))
    ray.get([w.load_state_dict.remote(s) for w, s in zip(workers, saved) if s])
    worker_states[:len(saved)] = saved[:len(workers)]
    positions = {w: s["prompt_source"]["draws"] for w, s in enumerate(worker_states) if s}
    ahead = ray.get(buffer.ledger_ahead_of.remote(positions))
    if ahead:
        log.warning("stage %r: %d prompt place(s) of the ledger lie past the restored worker positions; they will "
                    "be drawn again and dropped as repeats", stage_name, ahead)
    log.info("stage %r: resumed at trainer step %d (buffer counters and %d worker prompt position(s) "
             "restored)", stage_name, trainer_step, min(len(saved), len(workers)))
    return passed_on
