"""Keel's trainer side: the runtime library a training script uses to talk to its node
agent (``trainer.runtime``) and the reference FSDP2 trainer (``python -m trainer.train``)
with its model, resumable synthetic data and durable DCP checkpoints."""
