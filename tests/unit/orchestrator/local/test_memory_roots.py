"""keel up's simulated nodes' memory under /dev/shm: marked with the keel up it is, and
swept by the next keel up once that one is gone without giving it back."""

import os
from pathlib import Path

from orchestrator.local.cluster import OWNER_FILE, claim_memory_root, sweep_memory_roots


def test_a_root_whose_keel_up_is_gone_is_swept_and_a_live_ones_is_kept(tmp_path: Path):
    live = tmp_path / "keel-up-live"
    claim_memory_root(live)
    (live / "node-0").mkdir()
    gone = tmp_path / "keel-up-gone"
    gone.mkdir()
    (gone / "node-0").mkdir()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    no_process = next(p for p in range(pid_max - 1, 1, -1) if not Path(f"/proc/{p}").exists())
    (gone / OWNER_FILE).write_text(f"{no_process} 1\n")
    reused = tmp_path / "keel-up-reused"  # its pid now names another process
    reused.mkdir()
    (reused / OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    making = tmp_path / "keel-up-making"  # no owner yet: may be being made
    making.mkdir()
    other = tmp_path / "keel-other"
    other.mkdir()
    assert sweep_memory_roots(tmp_path) == [gone, reused]
    assert live.is_dir() and making.is_dir() and other.is_dir()
    assert not gone.exists() and not reused.exists()
    assert sweep_memory_roots(tmp_path) == []
