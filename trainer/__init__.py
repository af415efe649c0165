"""Keel's trainer side: the runtime library a training script uses to talk to its node
agent (``trainer.runtime``) and the reference composite-parallel trainer (``python -m
trainer.train``): its layout and device mesh (``mesh``), model (``model``), tensor
parallelism, activation checkpointing and FSDP2 (``parallelize``), pipeline stages and
schedules (``pipeline``), one optimizer step (``step``, ``clipping``, ``optim``),
resumable synthetic data (``data``) with its exactly-once ledger (``ledger``), and
asynchronous, reshardable DCP checkpoints (``checkpoint``)."""
