"""The bootstrap (`flywheel bootstrap`): simulated offline GRPO before the first release.
`midtrain.py` mid-trains on demonstrations, `run.py` runs GRPO from it (in process, or through
the trainer's side of the rollout fleet, `fleet.py`, which issues jobs to the workers of
simulate/rollout_worker.py and publishes each policy version through `policy_publisher.py`);
`task_sampler.py` chooses the tasks a step trains on; `local_engine.py` the in-process engine;
`config.py` its settings."""
