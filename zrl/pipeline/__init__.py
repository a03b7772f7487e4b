"""The asynchronous RL pipeline on Ray: pools, rollout workers, verifiers, the stage loops, the cascade.

Each actor is a plain class in its own file (rollout_worker.py, trainer_rank.py, verifier.py; the
buffer is zrl/buffer.py); pools.py is where `ray.remote` is applied and resources are reserved. An RL
stage is schedule.py (the policy, no Ray) driven by rl_stage.py (the transport; its calls in flight are
the records of stage_calls.py, its verifiers verifier_pool.py), reporting through stage_report.py;
weight_sync.py is the collective weight stream from trainer rank 0 to the workers; faults.py holds why
a stage stops (signals, the progress watchdog, failed trainer ranks).
"""
