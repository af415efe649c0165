"""The job `keel up` submits for the reference trainer at any world size."""

import pytest

from orchestrator.local.options import UpOptions, job_spec, reference_global_batch


@pytest.mark.parametrize("world_size, batch", [(1, 16), (2, 16), (3, 48), (4, 16), (6, 48),
                                               (5, 80), (12, 48)])
def test_the_global_batch_is_one_every_rank_can_share(world_size, batch):
    assert reference_global_batch(world_size) == batch
    assert batch % world_size == 0 and batch % 16 == 0


def test_three_single_slot_nodes_get_a_batch_they_divide(tmp_path):
    spec = job_spec(UpOptions(nodes=3, slots_per_node=1), tmp_path)
    assert "--global-batch=48" in spec.command and spec.training.global_batch == 48


def test_arguments_after_the_double_dash_reach_the_trainer_and_the_plan(tmp_path):
    spec = job_spec(UpOptions(nodes=2, slots_per_node=1,
                              script_args=("--dim", "128", "--global-batch=32", "--lr", "1e-3")),
                    tmp_path)
    assert list(spec.command[-5:]) == ["--dim", "128", "--global-batch=32", "--lr", "1e-3"]
    # What the controller validates and plans with is what the trainer will build.
    assert (spec.model.hidden, spec.training.global_batch) == (128, 32)
    assert spec.model.params > job_spec(UpOptions(nodes=2, slots_per_node=1),
                                        tmp_path).model.params


@pytest.mark.parametrize("args, message", [
    (("--steps", "5"), "--steps after --: keel up sets it; give keel up --steps instead"),
    (("--checkpoint-dir=/x",), "give keel up --workdir instead"),
    (("--dim", "wide"), "argument --dim: invalid int value: 'wide'"),
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    (("--global-batch", "7"), "global_batch"),
])
def test_bad_trainer_arguments_are_refused_before_anything_starts(tmp_path, args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        job_spec(UpOptions(nodes=2, slots_per_node=1, script_args=args), tmp_path)
