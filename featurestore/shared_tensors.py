"""Byte buffers another process on this machine maps instead of receiving: POSIX shared memory on
CPU, CUDA IPC on a GPU (the device's own memory, opened by the other process: no copy through the
host). A weight broadcast between colocated processes (a trainer and the inference servers on its
machine, or on its GPU) moves its buckets through a few of these (``featurestore.weight_broadcast``).

A handle is plain JSON (never pickle): a shared-memory file's name under a fixed pattern, or a
CUDA allocation's IPC handle with the GPU's UUID (device numbers differ between processes that
see different ``CUDA_VISIBLE_DEVICES``). Shared-memory files are created ``0600`` under a random
128-bit name, so only this user's processes that were told the name open them, and the exporter
unlinks them as soon as its readers have them open.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import mmap
import os
import re
import secrets
import socket
import tempfile
from typing import Any

import torch

from featurestore.errors import FeatureStoreError

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SHM_NAME = re.compile(r"featurestore-broadcast-[0-9a-f]{32}")


def machine_id() -> str:
    """Who can map this process's shared memory: processes of the same user and boot that see
    the same shared-memory file system (another container has its own ``/dev/shm``, another user
    cannot open a ``0600`` file: either gets another id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    shm = os.stat(_SHM_DIR)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return hashlib.sha256(f"{boot}:{shm.st_dev}:{shm.st_ino}:{uid}".encode()).hexdigest()[:32]


class Exported:
    """A buffer this process shares: ``tensor`` (uint8, ``nbytes`` long) and the ``handle`` that
    opens it elsewhere. ``unlink`` once every reader has opened it; ``close`` when done."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self._map: mmap.mmap | None = None
        self._path: str | None = None
        if device.type == "cuda":
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self.handle = _cuda_handle(self.tensor)
        elif device.type == "cpu":
            name = f"featurestore-broadcast-{secrets.token_hex(16)}"
            self._path = os.path.join(_SHM_DIR, name)
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                self._map = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            self.handle = {"kind": "shm", "name": name, "nbytes": nbytes}
        else:
            raise FeatureStoreError(f"no shared memory for {device.type} tensors")

    def unlink(self) -> None:
        """Remove the name (readers that opened it keep their mapping); CUDA memory has none."""
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None

    def close(self) -> None:
        self.unlink()
        cuda, self.tensor = self.tensor.is_cuda, torch.empty(0, dtype=torch.uint8)
        if cuda:  # free what readers have let go of now, not at exit
            torch.cuda.ipc_collect()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: closed when it goes
                self._map.close()
            self._map = None


def attach(handle: dict[str, Any]) -> torch.Tensor:
    """The buffer ``handle`` names, mapped into this process (uint8)."""
    kind = handle.get("kind")
    if kind == "shm":
        name, nbytes = str(handle.get("name", "")), int(handle.get("nbytes", -1))
        if not _SHM_NAME.fullmatch(name) or nbytes < 0:
            raise FeatureStoreError(f"not a broadcast's shared memory: {handle!r}")
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size != nbytes:
                raise FeatureStoreError(f"shared memory {name} is not {nbytes} bytes")
            mapped = mmap.mmap(fd, nbytes) if nbytes else bytearray()
        finally:
            os.close(fd)
        return torch.frombuffer(mapped, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    if kind == "cuda_ipc":
        return _open_cuda(handle)
    raise FeatureStoreError(f"unknown shared-memory handle {kind!r}")


def _cuda_handle(tensor: torch.Tensor) -> dict[str, Any]:
    storage = tensor.untyped_storage()
    device, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
    return {
        "kind": "cuda_ipc",
        "gpu": str(torch.cuda.get_device_properties(device).uuid),
        "handle": base64.b64encode(handle).decode(),
        "storage_bytes": size,
        "storage_offset": offset,
        "counter": base64.b64encode(counter).decode(),
        "counter_offset": counter_offset,
        "event": base64.b64encode(event or b"").decode(),
        "event_sync": bool(event_sync),
        "nbytes": tensor.numel(),
    }


def _open_cuda(handle: dict[str, Any]) -> torch.Tensor:
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    index = visible.get(handle.get("gpu", ""))
    if index is None:
        raise FeatureStoreError(f"the broadcast's GPU {handle.get('gpu')} is not visible to this process")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(  # (torch.multiprocessing's own call)
        index,
        base64.b64decode(handle["handle"]),
        int(handle["storage_bytes"]),
        int(handle["storage_offset"]),
        base64.b64decode(handle["counter"]),
        int(handle["counter_offset"]),
        base64.b64decode(handle["event"]),
        bool(handle["event_sync"]),
    )
    tensor = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    return tensor.set_(storage, 0, (int(handle["nbytes"]),), (1,))
