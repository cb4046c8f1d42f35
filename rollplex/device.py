"""Device memory as the engine and the memory plan see it, and data between host and device without waits."""

from __future__ import annotations

import os

import torch


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a host tensor or a list of numbers) as a tensor on `device`, copied without making the
    host wait for the device: torch's default host-to-device copy synchronizes the stream after it,
    so every small index tensor a pass builds would wait for the stream's earlier work. Without
    blocking, CUDA stages pageable host memory before the call returns, so the source may go at once."""
    return torch.as_tensor(data, dtype=dtype).to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`t` copied to the host without making the host wait: into pinned memory, with the
    event that marks the copy done (wait on it before reading). On CPU, `t` itself and None."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors: on CUDA the device's free memory plus what the
    caching allocator holds but no tensor uses (last rollout's KV pool, say); on
    CPU the available RAM."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
