"""Prefix slices never make the host wait for the device.

The overlap schedule issues prompt work in slices between decode steps
(rollplex.rl.prompt_work). A slice that copies host data to the GPU, reads a device
value back, or runs an op whose output size depends on device data blocks the
host until the side stream gets there, so the next decode step waits behind the
slices queued before it. PromptWorkScheduler therefore prepares every item's device
tensors when it is made, before decode, and the slices only launch kernels.

On CPU nothing waits, so `HostSyncGuard` records the calls that would on CUDA,
at the two levels where they can be seen: torch's dispatcher for the ops that
read device memory on the host (`_local_scalar_dense` behind item/int/bool,
`nonzero`, boolean-mask indexing, ...) or turn host data into a tensor
(`lift_fresh`); and the Python API for what never reaches the dispatcher on
CPU (`tolist`, `numpy`, `.to(device)`, which is a no-op there). It cannot see a
sync that a CUDA kernel's C++ code does by itself; on a GPU,
torch.cuda.set_sync_debug_mode("error") around `between_steps` covers that.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import rollplex.ops.attention
from rollplex.models import build_model
from rollplex.models.packing import pack_sequences
from rollplex.models.inputs import VisionEmbeds
from rollplex.rl.prompt_work import PromptWorkScheduler, PromptWork
from test_model import tiny_args
from test_shared_prefix import groups

# Dispatcher ops that, on CUDA, read device memory on the host (the host waits) or copy host data to the device.
_SYNCING_OPS = {"_local_scalar_dense", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
                "unique_consecutive", "lift_fresh"}
_BOOL_INDEXED_OPS = {"index", "index_put", "index_put_"}  # a boolean mask index runs nonzero
_HOST_READS = {"tolist", "numpy"}  # Python-level reads that dispatch nothing on CPU
_MOVES = {"to", "cuda", "cpu", "pin_memory"}
_FACTORIES = {"tensor", "as_tensor"}  # from host data


class _SyncingOps(TorchDispatchMode):
    def __init__(self, found: list[str], copies: bool):
        super().__init__()
        self.found, self.copies = found, copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bool_index = name in _BOOL_INDEXED_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        unsized_repeat = name == "repeat_interleave" and kwargs.get("output_size") is None
        if (name in _SYNCING_OPS and not (self.copies and name == "lift_fresh")) or bool_index or unsized_repeat:
            self.found.append(f"aten.{name}")
        return func(*args, **kwargs)


class _HostCalls(TorchFunctionMode):
    def __init__(self, found: list[str], copies: bool):
        super().__init__()
        self.found, self.copies = found, copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        moves = name in _MOVES and (name != "to" or "device" in kwargs or any(
            isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:]))
        if self.copies:
            # Host data becomes a tensor on the host (no wait), and reaches the device without blocking; a
            # factory given both host data and a device copies it with torch's blocking copy.
            moves = (moves and not kwargs.get("non_blocking")) or (name in _FACTORIES and "device" in kwargs)
        if name in _HOST_READS or moves:
            self.found.append(f"Tensor.{name}")
        return func(*args, **kwargs)


class HostSyncGuard:
    """Within the block, `calls` lists each call that would copy host data to a
    CUDA device or make the host wait for it; with `copies=True`, each that would make
    the host wait: a copy of host data to the device without blocking is allowed.

    torch cannot make a tensor subclass under a dispatch mode, so the attention's
    bottom-right causal mask (a CausalBias, made per call from two lengths on the
    host) is made outside the guard's modes; attention with it runs inside them."""

    def __init__(self, copies: bool = False):
        self.copies = copies

    def __enter__(self) -> "HostSyncGuard":
        self.calls: list[str] = []
        self._modes = [_SyncingOps(self.calls, self.copies), _HostCalls(self.calls, self.copies)]
        self._mask = rollplex.ops.attention.causal_lower_right
        rollplex.ops.attention.causal_lower_right = _outside_modes(self._mask)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        rollplex.ops.attention.causal_lower_right = self._mask


def _outside_modes(make):
    def made(*args):
        with _disable_current_modes():
            return make(*args)
    return made


def test_the_guard_sees_each_kind_of_host_sync():
    t = torch.arange(4)
    with HostSyncGuard() as guard:
        torch.tensor([1, 2])
        int(t[0])
        t.tolist()
        t.to("cpu")
        t[t > 1]
        t.repeat_interleave(t)
        t.to(torch.float32)[torch.arange(2)]  # a dtype change and a gather by an index tensor: no sync
    assert guard.calls == ["aten.lift_fresh", "aten._local_scalar_dense", "Tensor.tolist", "Tensor.to",
                           "aten.index", "aten.repeat_interleave"]
    with HostSyncGuard(copies=True) as guard:
        torch.as_tensor([1, 2]).to("cpu", non_blocking=True)  # rollplex.device.to_device: no wait
        torch.tensor([1, 2], device="cpu")  # torch's blocking copy on CUDA
        t.to("cpu")
        t.tolist()
    assert guard.calls == ["Tensor.tensor", "Tensor.to", "Tensor.tolist"]


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_args(), seed=5, init_std=None)


def test_prefix_slices_copy_nothing_to_the_device_and_read_nothing_back(model):
    """The actor's item runs the vision tower with its graph; the reference-like
    item reads cached vision features: every slice of both only launches kernels."""
    prompts = [g.prompt for g in groups()]
    cached = VisionEmbeds.concat([model.encode_vision(p.pixel_values, p.image_grid_thw, p.pixel_values_videos,
                                                      p.video_grid_thw) for p in prompts])
    items = [PromptWork("actor", 0, model, prompts, None, keep_graph=True, estimate=0),
             PromptWork("ref", 0, model, prompts, cached, keep_graph=False, estimate=0)]
    scheduler = PromptWorkScheduler(items, budget_bytes=None)  # prepares the items: host reads and copies happen here
    with HostSyncGuard() as guard:
        while scheduler.queue:
            scheduler.between_steps(running=1)
    assert guard.calls == []

    hidden = model.forward_packed(pack_sequences(model.args, prompts))
    last = torch.tensor([len(p.input_ids) for p in prompts]).cumsum(0) - 1
    for kind in ("actor", "ref"):
        assert torch.equal(scheduler.result(kind, 0).last_hidden, hidden[last])


def test_a_packed_pass_reads_nothing_back_in_its_layers(model):
    """Sequences packed one per sample (share_prefix false), each attending only to itself:
    the attention's index tensors are built once, from the host's boundaries, so no decoder
    layer waits on the device (each used to read the boundaries back twice, and rebuild them).
    (The model's forward finds its vision slots once, before the layers.)"""
    from rollplex.models.inputs import Prompt
    from rollplex.ops.attention import VarlenAttention

    batch = pack_sequences(model.args, [Prompt(torch.arange(n) + 10) for n in (5, 3, 5, 8)])
    attn = VarlenAttention(batch.cu_seqlens.tolist(), "cpu")
    embedded = model.language_model.embed_tokens(batch.input_ids)
    with HostSyncGuard() as guard:
        hidden = model.language_model(embedded, batch.position_ids, attn)
    assert guard.calls == [] and hidden.shape[0] == 21
    whole = model.language_model(embedded[:5], batch.position_ids[:, :5], VarlenAttention([0, 5], "cpu"))
    torch.testing.assert_close(hidden[:5], whole, rtol=0, atol=1e-5)  # the first sequence sees only itself
