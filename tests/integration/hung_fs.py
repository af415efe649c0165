"""A filesystem whose reads never return, as a hung NFS or Lustre server's do: FUSE,
spoken in pure Python on ``/dev/fuse`` (no libfuse), mounted with mount(2) (root only).

It holds one file, ``data``. Lookups, attributes, opens and closes are answered; a read
is taken from the kernel and never answered, so the reader waits in the kernel
(``request_wait_answer``): asleep until a signal, and in uninterruptible sleep (state
D) once a fatal one is pending, which SIGKILL then cannot end. Only aborting the
connection ends it (the reader gets an error, then dies of its pending signal), which
``HungFilesystem`` does on the way out, however the test ended, before it unmounts.

Nothing of the test itself may read the file: it would hang just the same.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import threading
from pathlib import Path

MS_NOSUID, MS_NODEV = 2, 4
# Opcodes (linux/fuse.h) this filesystem answers or takes without an answer.
LOOKUP, FORGET, GETATTR, OPEN, READ, FLUSH, RELEASE, INIT = 1, 2, 3, 14, 15, 25, 18, 26
INTERRUPT, BATCH_FORGET, DESTROY = 36, 42, 38
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, ...
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr: ino, size, blocks, times, mode ...
ROOT, DATA = 1, 2
CACHE_S = 3600  # lookups and attributes are cached this long: nothing asks again
FOPEN_DIRECT_IO = 1  # reads go to us, not to the page cache


def _attr(node: int) -> bytes:
    mode = 0o40755 if node == ROOT else 0o100444
    return ATTR.pack(
        node, 4096 if node == DATA else 0, 8, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0
    )


class HungFilesystem:
    """``with HungFilesystem(path) as fs:`` mounts it at ``path`` (made if missing);
    ``fs.file`` is the file whose reads hang. ``connection`` is the kernel's number of
    the mount's FUSE connection (``/sys/fs/fuse/connections/N``)."""

    def __init__(self, mountpoint: Path):
        self.mountpoint = mountpoint
        self.file = mountpoint / "data"
        self.fd = -1
        self.connection = 0
        self.reads_taken = 0  # reads the kernel handed us, never answered
        self._thread: threading.Thread | None = None
        self._mounted_control = False  # we mounted fusectl, and unmount it after

    def __enter__(self) -> HungFilesystem:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        # Not inherited by the daemons the test starts: the last descriptor's close
        # aborts the connection, and it must be ours.
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        options = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other"
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(
            b"keel-hung-fs",
            str(self.mountpoint).encode(),
            b"fuse.keel-hung-fs",
            MS_NOSUID | MS_NODEV,
            options.encode(),
        ):
            code = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(code, f"mount fuse at {self.mountpoint}: {os.strerror(code)}")
        self.connection = self._device_minor()
        control = Path("/sys/fs/fuse/connections")
        if not (control / str(self.connection)).exists():
            # fusectl not mounted: its abort file is the one way to end a read that a
            # thread of ours is blocked taking requests through (a close waits for it).
            subprocess.run(["mount", "-t", "fusectl", "fusectl", str(control)], check=True)
            self._mounted_control = True
        self._thread = threading.Thread(target=self._serve, name="hung-fs", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.abort()
        subprocess.run(["umount", "--lazy", str(self.mountpoint)], capture_output=True)
        if self._mounted_control:
            subprocess.run(["umount", "/sys/fs/fuse/connections"], capture_output=True)

    def abort(self) -> None:
        """End every request waiting on the filesystem (the readers get ECONNABORTED)."""
        abort = Path(f"/sys/fs/fuse/connections/{self.connection}/abort")
        if abort.exists():
            abort.write_text("1")
        if self._thread is not None:
            self._thread.join(10)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _device_minor(self) -> int:
        """The mount's device minor, which numbers its FUSE connection: read from
        /proc/self/mountinfo, not by a stat of the mount (which would ask us)."""
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[4] == str(self.mountpoint):
                return int(fields[2].split(":")[1])
        raise RuntimeError(f"{self.mountpoint} is not in /proc/self/mountinfo")

    def _serve(self) -> None:
        while True:
            try:
                request = os.read(self.fd, 1 << 20)
            except OSError as exc:
                if exc.errno in (errno.ENODEV, errno.EBADF, errno.ECONNABORTED):
                    return  # aborted, or unmounted
                if exc.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                    continue  # a request interrupted before we read it
                raise
            _, opcode, unique, node, *_ = IN_HEADER.unpack_from(request)
            body = request[IN_HEADER.size :]
            if opcode in (FORGET, BATCH_FORGET, INTERRUPT):
                continue  # no answer expected (an interrupt of a read: none given)
            if opcode == READ:
                self.reads_taken += 1
                continue  # the hang
            self._answer(unique, *self._handle(opcode, node, body))

    @staticmethod
    def _handle(opcode: int, node: int, body: bytes) -> tuple[int, bytes]:
        if opcode == INIT:
            _major, _minor, readahead, _flags = struct.unpack_from("<IIII", body)
            # fuse_init_out: protocol 7.31, no optional features, 64 KiB writes.
            init = struct.pack("<IIIIHHIIHHII", 7, 31, readahead, 0, 16, 12, 65536, 1, 16, 0, 0, 0)
            return 0, init + b"\0" * 24
        if opcode == LOOKUP:
            if node == ROOT and body.split(b"\0", 1)[0] == b"data":
                entry = struct.pack("<QQQQII", DATA, 0, CACHE_S, CACHE_S, 0, 0)
                return 0, entry + _attr(DATA)
            return errno.ENOENT, b""
        if opcode == GETATTR:
            return 0, struct.pack("<QII", CACHE_S, 0, 0) + _attr(node)
        if opcode == OPEN:
            return 0, struct.pack("<QII", 0, FOPEN_DIRECT_IO, 0)
        if opcode in (FLUSH, RELEASE, DESTROY):
            return 0, b""
        return errno.ENOSYS, b""

    def _answer(self, unique: int, error: int, payload: bytes) -> None:
        try:
            os.write(
                self.fd, OUT_HEADER.pack(OUT_HEADER.size + len(payload), -error, unique) + payload
            )
        except OSError as exc:
            # The requester was interrupted and gave up (ENOENT), or we were aborted.
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                raise
