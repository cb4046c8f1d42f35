"""Device memory as the engine and the memory plan see it."""

from __future__ import annotations

import os

import torch


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors: on CUDA the device's free memory plus what the
    caching allocator holds but no tensor uses (last rollout's KV pool, say); on
    CPU the available RAM."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
