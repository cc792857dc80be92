"""The online trainer (`flywheel train-online`): joined live feedback (`experiences`) in, a
better policy out, handed to the release pipeline. `trainer.py` is the trainer and its
collective phases, `loop.py` the process around it (Kafka, batches, checkpoints, control,
release cadence); `loss.py`, `baseline.py` and `batch.py` the objective, its baselines and the
rows a batch is packed into; `config.py` its settings; `control.py` the admin's commands."""
