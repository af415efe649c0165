"""``python -m trainer.check_args ARGS``: parse the reference trainer's command line as
``python -m trainer.train ARGS`` would, and print the model and batch it would train
(one JSON object: dim, layers, heads, vocab, seq_len, global_batch), or its parser's
error on stderr with exit status 2. ``keel up`` runs it to plan with what the trainer
will build, without importing the trainer (or torch) itself."""

import json
import sys

from trainer.options import parse_args

FIELDS = ("dim", "layers", "heads", "vocab", "seq_len", "global_batch")

if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])
    print(json.dumps({field: getattr(parsed, field) for field in FIELDS}))
