"""The asynchronous RL pipeline on Ray: pools, rollout workers, verifiers, the stage loops, the cascade.

Each actor is a plain class in its own file (rollout_worker.py, trainer_rank.py, verifier.py; the
buffer is zrl/buffer.py); pools.py is where `ray.remote` is applied and resources are reserved.
"""
