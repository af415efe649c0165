"""`keel up -- ARGS`: the reference trainer's own flags, checked by its own parser (in a
process of its own, as the trainer runs) before anything starts, and planned with."""

import pytest

from orchestrator.local.options import UpOptions, job_spec


def test_arguments_after_the_double_dash_reach_the_trainer_and_the_plan(tmp_path):
    spec = job_spec(
        UpOptions(
            nodes=2,
            slots_per_node=1,
            script_args=("--dim", "128", "--global-batch=32", "--lr", "1e-3"),
        ),
        tmp_path,
    )
    assert list(spec.command[-5:]) == ["--dim", "128", "--global-batch=32", "--lr", "1e-3"]
    # What the controller validates and plans with is what the trainer will build.
    assert (spec.model.hidden, spec.training.global_batch) == (128, 32)
    assert spec.model.params > job_spec(UpOptions(nodes=2, slots_per_node=1), tmp_path).model.params


@pytest.mark.parametrize(
    "args, message",
    [
        (("--steps", "5"), "--steps after --: keel up sets it; give keel up --steps instead"),
        (("--checkpoint-dir=/x",), "give keel up --workdir instead"),
        (("--dim", "wide"), "argument --dim: invalid int value: 'wide'"),
        (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
        (("--global-batch", "7"), "global_batch"),
    ],
)
def test_bad_trainer_arguments_are_refused_before_anything_starts(tmp_path, args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        job_spec(UpOptions(nodes=2, slots_per_node=1, script_args=args), tmp_path)
