"""The asynchronous RL pipeline on Ray: pools, rollout workers, verifiers, the stage loops, the cascade.

Each actor is a plain class in its own file (rollout_worker.py, trainer_rank.py, verifier.py; the
buffer is zrl/buffer.py); pools.py is where `ray.remote` is applied and resources are reserved. An RL
stage is schedule.py (the policy, no Ray: typed requests out, typed answers in) driven by rl_stage.py
(the Ray transport; its calls in flight are the records of stage_calls.py), with its parts: a group's
verification and admission (stage_admission.py, verifiers verifier_pool.py), weight syncs
(sync_coordinator.py, one class per transport; weight_sync.py is the collective weight stream from
trainer rank 0 to the workers), worker restarts (worker_restarts.py), reporting (stage_report.py), the
checkpointed data state (stage_state.py); faults.py holds why a stage stops (signals, the progress
watchdog, failed trainer ranks).
"""
