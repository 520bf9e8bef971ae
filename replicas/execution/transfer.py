"""One host-to-device copy and one device-to-host copy per pass.

Everything a pass needs on the device (token ids, positions, slots, block tables, keep rows,
sampling parameters, seeded noise, grammar bitmasks) is written into one host buffer at
8-byte-aligned offsets and sent in one copy; each part is then a typed view of the device
buffer. On CUDA the host buffer is pinned and reused (the copy is asynchronous; the previous
pass's copy has finished by the time the buffer is rewritten, since every pass ends with the
blocking copy back). Results come back the same way: parts of one device buffer, one copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 8  # bytes: the widest element packed (int64 / float64)


class Part:
    """Where one array lies in a pack: byte offset, dtype, shape, size in bytes."""

    __slots__ = ("offset", "dtype", "shape", "nbytes")

    def __init__(self, offset: int, dtype: np.dtype, shape: tuple[int, ...], nbytes: int) -> None:
        self.offset, self.dtype, self.shape, self.nbytes = offset, dtype, shape, nbytes


class HostPack:
    """The host side of one pass's upload: arrays added in any order, sent together."""

    def __init__(self) -> None:
        self._arrays: list[tuple[int, np.ndarray]] = []
        self._size = 0
        self.host_buffer: torch.Tensor | None = None  # (bytes,) uint8 on the host, once sent
        self.device_buffer: torch.Tensor | None = None  # (bytes,) uint8, once sent

    def add(self, values: np.ndarray | Sequence, dtype: type | np.dtype | None = None) -> Part:
        """Add an array (a numpy array keeps its dtype unless one is given; a list is int64)."""
        if dtype is None:
            dtype = values.dtype if isinstance(values, np.ndarray) else np.int64
        a = np.ascontiguousarray(values, dtype=dtype)
        offset = -(-self._size // _ALIGN) * _ALIGN
        self._arrays.append((offset, a))
        self._size = offset + a.nbytes
        return Part(offset, a.dtype, a.shape, a.nbytes)

    def send(self, device: torch.device, staging: Staging) -> None:
        """Write every array into the staging buffer and copy it to `device` in one transfer."""
        host = staging.buffer(max(self._size, _ALIGN))
        view = host.numpy()
        for offset, a in self._arrays:
            view[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        self.host_buffer = host[:max(self._size, _ALIGN)]
        self.device_buffer = upload(self.host_buffer, device)
        staging.sent()

    @classmethod
    def received(cls, data: np.ndarray, device: torch.device, staging: Staging) -> HostPack:
        """A pack another rank built and sent (its bytes, `host_buffer`), uploaded here the same
        way: its parts are read with the sender's `Part`s (tensor parallelism's workers)."""
        pack = cls()
        host = staging.buffer(max(data.nbytes, _ALIGN))
        host.numpy()[:data.nbytes] = data
        pack._size = data.nbytes
        pack.host_buffer = host[:max(data.nbytes, _ALIGN)]
        pack.device_buffer = upload(pack.host_buffer, device)
        staging.sent()
        return pack

    def get(self, part: Part) -> torch.Tensor:
        """The part as a typed tensor on the device (a view of the sent buffer)."""
        raw = self.device_buffer[part.offset:part.offset + part.nbytes]
        return raw.view(_TORCH_DTYPES[part.dtype]).view(part.shape)


class Staging:
    """A reusable host buffer for the pack (pinned on CUDA, where pinning once is cheap and
    pinning every pass is not)."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self._buf = torch.empty(0, dtype=torch.uint8, device="cpu")
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffer

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The buffer to fill, once the previous copy out of it has finished (a pass normally
        ends by waiting for its results, so this does not wait)."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._buf.numel() < nbytes:
            size = max(nbytes, 2 * self._buf.numel(), 1 << 16)
            self._buf = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self.pinned)
        return self._buf

    def sent(self) -> None:
        """A copy out of the buffer was queued (on CUDA: remembered, see `buffer`)."""
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The pass's one host-to-device copy (asynchronous from pinned memory)."""
    return host.to(device, non_blocking=host.is_pinned())


def download(parts: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The pass's one device-to-host copy: `parts` (any shape and dtype) joined as bytes,
    copied, split back into flat numpy arrays of their own dtypes."""
    return Readback(parts).wait()


class Readback:
    """The pass's one device-to-host copy, started: on CUDA into pinned memory behind an event
    (the host learns the results when it asks, a pass later in the overlapped loop); elsewhere
    a plain copy."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self._layout = [(p.numel() * p.element_size(), _NUMPY_DTYPES[p.dtype]) for p in parts]
        self._event: torch.cuda.Event | None = None
        if not parts:
            self._host = None
            return
        raw = torch.cat([_bytes(p) for p in parts]) if len(parts) > 1 else _bytes(parts[0])
        if raw.device.type == "cuda":  # torch caches pinned blocks: no pinning per pass
            self._host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
            self._host.copy_(raw, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = raw.cpu()

    def wait(self) -> list[np.ndarray]:
        """The parts as flat numpy arrays of their own dtypes, once the copy has arrived."""
        if self._host is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        host = self._host.numpy()
        out, offset = [], 0
        for n, dtype in self._layout:
            out.append(host[offset:offset + n].view(dtype))
            offset += n
        return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat uint8 tensor (an empty one may carry any strides: numpy's
    argmax over no rows has stride 0, which `view` refuses)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.contiguous().view(-1).view(torch.uint8)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                 np.dtype(np.uint8): torch.uint8, np.dtype(np.bool_): torch.bool}
_NUMPY_DTYPES = {t: n for n, t in _TORCH_DTYPES.items()}
