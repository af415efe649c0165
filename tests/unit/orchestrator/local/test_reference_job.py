"""The job `keel up` submits for the reference trainer at any world size."""

import pytest

from orchestrator.local.options import UpOptions, job_spec, reference_global_batch


@pytest.mark.parametrize(
    "world_size, batch", [(1, 16), (2, 16), (3, 48), (4, 16), (6, 48), (5, 80), (12, 48)]
)
def test_the_global_batch_is_one_every_rank_can_share(world_size, batch):
    assert reference_global_batch(world_size) == batch
    assert batch % world_size == 0 and batch % 16 == 0


def test_three_single_slot_nodes_get_a_batch_they_divide(tmp_path):
    spec = job_spec(UpOptions(nodes=3, slots_per_node=1), tmp_path)
    assert "--global-batch=48" in spec.command and spec.training.global_batch == 48


def test_a_negative_linger_is_refused_with_what_to_give():
    with pytest.raises(ValueError, match=r"--linger-s must be 0 \(stop at once\) or more"):
        UpOptions(linger_s=-1)
    assert UpOptions(linger_s=6).linger_s == 6
