"""The engine runs on the trainer's own parameters: no second copy of the weights.

At rollout start every FSDP2 unit of the trainer's model is unsharded (its
parameters gathered over the dp_shard dimension) and told not to reshard after
forward, so the engine's prefill and decode steps read the gathered parameters
in place. After rollout the units reshard, freeing the gathered memory before
the training passes.

Per parameter, the trainer's layout is compared with the engine's: with the
same TP size, every parameter is *aligned* (the engine's tensor is the
trainer's unsharded parameter itself, same storage). Engines with a TP size
different from the trainer's (views or rebuilt buffers) are not built yet:
`rollout.tp` must equal `parallel.tp`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from rollplex.models.qwen2_5_vl import Qwen2_5_VL


@dataclass
class SharingReport:
    bytes_shared: int = 0  # engine reads the trainer's tensor itself
    bytes_viewed: int = 0  # engine reads a slice / stride view of it
    bytes_rebuilt: int = 0  # engine holds its own buffer, refilled after each update
    seconds: float = 0.0  # time to make the weights ready for the engine (gather)

    def as_metrics(self) -> dict[str, float]:  # byte counts stay ints: exact in metrics.jsonl
        return {"weights/bytes_shared": self.bytes_shared, "weights/bytes_viewed": self.bytes_viewed,
                "weights/bytes_rebuilt": self.bytes_rebuilt, "timing_s/update_weights": self.seconds}


class SharedWeights:
    def __init__(self, model: Qwen2_5_VL, trainer_tp: int = 1, engine_tp: int = 1):
        if trainer_tp != engine_tp:
            raise NotImplementedError(
                f"rollout.tp={engine_tp} differs from parallel.tp={trainer_tp}: engines with their own TP layout "
                "(view / rebuild sharing) are not implemented yet; set rollout.tp to parallel.tp")
        self.model = model
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.report = SharingReport()

    @contextmanager
    def for_rollout(self):
        """Within this block the model's parameters are whole along dp and stay so
        across forwards; the engine uses them in place."""
        start = time.perf_counter()
        for unit in self.units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        self.report.seconds = time.perf_counter() - start
        self.report.bytes_shared = sum(_local_bytes(p) for p in self.model.parameters())
        try:
            yield self.model
        finally:
            for unit in self.units:
                unit.reshard()
                unit.set_reshard_after_forward(True, recurse=False)


def _local_bytes(p: torch.Tensor) -> int:
    t = p.to_local() if hasattr(p, "to_local") else p
    return t.numel() * t.element_size()
