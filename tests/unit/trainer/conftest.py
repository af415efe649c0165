"""Fixtures the trainer's unit tests share."""

import gc

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo process group in this process, for code that calls collectives."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    gc.collect()
    dist.destroy_process_group()
