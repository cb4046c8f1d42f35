"""Runs the model for one engine step: prepare inputs, run, return last-token logits.

Prefill packs the step's sequences end to end (no padding) and runs eagerly.
Decode feeds one token per running sequence, its inputs made by the engine's
`DecodeBatch` on the host and copied over in one transfer (`StepInputs`), and
the rotary cos/sin of each fed token read off a table of text positions built
once (`MRotaryEmbedding.text_table`), not computed again each step. On
CUDA it replays a CUDA graph captured for the smallest batch-size bucket that
fits, with static input buffers that are refilled before each replay (padded
rows write into the KV pool's sink block and their logits are dropped). On CPU,
or with `enforce_eager`, the same decode inputs run eagerly through the same code.

With `shared_prefix_decode`, a decode step attends each GRPO group's shared prompt
blocks once for all its rows, eagerly or in a graph. All of that is behind one hook,
`cascade` (rollplex.engine.cascade.SharedPrefixDecode; None when off), which gives
an eager step its groups, and a graph's capture and replay their static group buffers.

A model whose layers carry a recurrent state (Qwen3.5's Gated DeltaNet) has a
state pool beside the KV pool (rollplex.engine.recurrent_state): a prefill writes
each sequence's final state into the slots of the rows that decode from it, a
decode step reads and updates each running row's slot, addressed in a graph
through a static buffer of slot indices as block tables are.

A graph bakes in the addresses it read at capture: each layer's K/V view of the
pool, the state pool, every weight and the rotary table. The pool stays at one address for the
engine's life (rollplex.engine.kv_cache), so graphs are captured once per run,
each batch-size bucket on its first use; the addresses are checked at each
generate()'s first decode step, and the graphs are dropped (and captured again
as their buckets are used) when any of them has moved: a pool released and
allocated again, weights the trainer gathered into new memory, a longer rotary
table.

A capture that runs out of device memory (a bucket first used mid-rollout, while
the caching allocator cannot give cached blocks back to it) does not end the run:
the partial graph is ended and dropped, the cache emptied, a warning says so, and
that bucket decodes eagerly (`eager_buckets`) until the graphs are dropped, when
it is tried again with the rest.

Decode steps run on the runner's decode stream, at the highest CUDA priority, so
that the GPU schedules their kernels ahead of the prompt work on the RL loop's
lower-priority side stream (see `on_decode_stream`); a prefill's forward runs on
the caller's stream (`on_caller_stream`).

Prefill and decode run the decoder layers with the fused Triton ops
(rollplex.ops.fused_decode_triton, `layer_ops`) where `fused_decode_enabled` says so
(on CUDA unless ROLLPLEX_FUSED_DECODE=0), else with the torch ops the trainer runs.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rollplex.device import to_device
from rollplex.dist import local_tensor
from rollplex.engine.cascade import SharedPrefixDecode, StepGroups
from rollplex.engine.decode_batch import DecodeBatch
from rollplex.engine.kv_cache import ContextPrefill, KVCache, PagedAttention
from rollplex.engine.recurrent_state import DecodeStates, PrefillStates, RecurrentStatePool
from rollplex.engine.routes import RouteLog
from rollplex.engine.sequence import Sequence
from rollplex.models.inputs import Observation, VisionEmbeds
from rollplex.models.moe import Routing, with_routing
from rollplex.models.protocol import VisionLanguageModel
from rollplex.ops.attention import PackedSegments
from rollplex.ops.fused_decode_triton import FUSED_OPS, fused_decode_enabled


@dataclass(frozen=True)
class PoolGeometry:
    """Where a KV pool's slots are: base address, shape and strides. A CUDA graph
    addresses every layer's K/V through these, as they were at capture."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, pool: torch.Tensor) -> PoolGeometry:
        return cls(pool.data_ptr(), tuple(pool.shape), pool.stride())

    def laid_on(self, pool: torch.Tensor) -> torch.Tensor:
        """This geometry over `pool`'s storage: the slots a graph captured with it
        reads and writes now. An error where a GPU would touch memory outside the pool."""
        storage, item = pool.untyped_storage(), pool.element_size()
        offset = self.address - storage.data_ptr()
        extent = offset + item * (1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides)))
        if offset < 0 or extent > storage.nbytes():
            raise RuntimeError(f"stale CUDA graph: captured on a KV pool {self.shape} at {self.address:#x}, "
                               f"which is not inside the current pool {tuple(pool.shape)} at {pool.data_ptr():#x}; "
                               "on a GPU it would read and write freed memory")
        return torch.as_strided(pool, self.shape, self.strides, offset // item)


@dataclass(frozen=True)
class GraphAddresses:
    """Everything a decode graph reads by address besides its own static buffers."""

    pool: PoolGeometry
    weights: tuple[int, ...]
    rotary_table: int
    states: tuple[PoolGeometry, PoolGeometry] | None = None  # the recurrent state pool's conv and recurrent slots


class ModelRunner:
    def __init__(self, model: VisionLanguageModel, cache: KVCache, max_model_len: int, max_num_seqs: int,
                 use_cuda_graphs: bool, shared_prefix_decode: bool = False, fused_decode: bool | None = None,
                 states: RecurrentStatePool | None = None):
        self.model, self.cache, self.states = model, cache, states
        self.device = model.device
        # The layers' fused ops, or None: the torch ops. Set before the first decode: graphs capture it.
        use_fused = fused_decode_enabled(self.device) if fused_decode is None else fused_decode
        self.layer_ops = FUSED_OPS if use_fused else None
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.rotary_table: torch.Tensor | None = None  # cos | sin of text positions 0, 1, ... (see reserve_rotary)
        self.max_num_seqs = max_num_seqs
        # On CPU the graph bookkeeping can still be exercised (tests set this True):
        # _EagerGraph replays the decode as captured, on the same static buffers.
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        text = model.args.text
        self.cascade = (SharedPrefixDecode(self.block_size, text.num_attention_heads // text.num_key_value_heads,
                                           max_num_seqs, self.max_blocks, cache.sink_block, self.device)
                        if shared_prefix_decode else None)
        # Batch-size buckets, ascending: a decode step replays the smallest graph that holds its batch.
        n = max_num_seqs
        self.buckets = sorted({b for b in (1, 2, 4, 8) if b <= n} | set(range(16, n + 1, 16)) | {n})
        self.graphs: dict[int, "torch.cuda.CUDAGraph | _EagerGraph"] = {}  # by bucket, captured at first use
        self.graph_logits: dict[int, torch.Tensor] = {}  # each graph's static output
        self.graph_routing: dict[int, Routing] = {}  # each graph's routes, static outputs too (MoE models)
        self.routes: RouteLog | None = None  # where a generation records its routes (set by the engine), or None
        self.graph_pool = None  # the CUDA memory pool the graphs share
        self.static: dict[str, torch.Tensor] | None = None  # the graphs' static inputs
        self.captured: GraphAddresses | None = None  # what the graphs read; anything else needs new graphs
        self.captures, self.capture_seconds = 0, 0.0  # graphs captured so far, and their wall time
        self.capture_failures = 0  # captures that ran out of memory (their buckets decode eagerly)
        # Buckets whose capture ran out of memory: they decode eagerly, without capturing again, until
        # `_drop_graphs` (the memory the dropped graphs held is free then, so they are tried again).
        self.eager_buckets: set[int] = set()
        self.start_generation()
        # Highest priority (the lowest number): decode kernels go before the prompt work's side stream.
        self.decode_stream = (torch.cuda.Stream(self.device, priority=min(torch.cuda.Stream.priority_range()))
                              if self.device.type == "cuda" else None)
        # Lowest priority: multi-turn observations' images are encoded there while decode goes on (`encode_aside`).
        self.vision_stream = torch.cuda.Stream(self.device, priority=0) if self.device.type == "cuda" else None

    def start_generation(self) -> None:
        """A generation starts, maybe on a pool allocated again or moved weights: its first
        graph replay checks the graphs' addresses first (`addresses`). The caller's stream
        now is the one prefill runs on."""
        self.addresses_may_have_moved = True
        self.captures_at_start = self.captures, self.capture_seconds, self.capture_failures
        self.caller_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def captures_since_start(self) -> tuple[int, float, int]:
        """Graphs captured in this generation, their wall time, and captures that ran out of memory."""
        captures, seconds, failures = self.captures_at_start
        return self.captures - captures, self.capture_seconds - seconds, self.capture_failures - failures

    def on_decode_stream(self) -> contextlib.AbstractContextManager[None]:
        """Run the enclosed work (an engine step: the decode batch's updates, KV block
        copies, input copies, graph replay, sampling) on the decode stream. It starts
        after the current stream's earlier work and the current stream's later work
        starts after it. The step's own temporaries are allocated, used and freed on
        the decode stream only (no record_stream needed); what lives longer (the pool,
        the weights, the decode batch's tensors) is used on both streams, each use
        ordered by these waits. A no-op on CPU."""
        return _switched_to(self.decode_stream)

    def on_caller_stream(self) -> contextlib.AbstractContextManager[None]:
        """Inside a step, run the enclosed work (a prefill's forward) on the stream the
        generation was started from, ordered as `on_decode_stream` orders its work."""
        return _switched_to(self.caller_stream)

    # ------------------------------------------------------------------ prefill

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence], slots: list[list[int]], state_rows: list[int] = (),
                state_sources: list[int] = ()) -> torch.Tensor:
        """Compute every token of each sequence, store its KV at `slots` and, where the model
        has recurrent layers, the final state of sequence `state_sources[j]` in the state slot of
        decode row `state_rows[j]`; return float32 logits (len(seqs), vocab) of each sequence's
        last token. On the caller's stream: its activations are the caller's memory."""
        with self.on_caller_stream():
            return self._prefill(seqs, slots, list(state_rows), list(state_sources))

    def _prefill(self, seqs: list[Sequence], slots: list[list[int]], state_rows: list[int],
                 state_sources: list[int]) -> torch.Tensor:
        dev = self.device
        # A sequence continuing its episode computes only its tokens past the K/V its blocks hold (num_cached).
        ids = torch.tensor([t for s in seqs for t in s.token_ids[s.num_cached:]], device=dev)
        positions = torch.cat([s.positions(s.num_cached, len(s)) for s in seqs], dim=1)
        bounds = [0, *itertools.accumulate(len(s) - s.num_cached for s in seqs)]
        states = None if self.states is None else PrefillStates(
            self.states, bounds, state_rows, state_sources, [s.kept_state if s.num_cached else None for s in seqs])
        attn = PagedAttention(self.cache, torch.tensor([x for sl in slots for x in sl], device=dev),
                              prefill=PackedSegments(bounds, True, self.model.attn_backend, dev),
                              backend=self.model.attn_backend, layer_ops=self.layer_ops, states=states,
                              context=self._context_of(seqs, bounds))
        prompt_mask = torch.cat([s.context_mask(s.num_cached, len(s)) for s in seqs]).to(dev)
        routing = Routing() if self.routes is not None else None
        with_routing(attn, routing)
        hidden = self.model(ids, positions, attn, self._vision_of(seqs), prompt_mask)
        if routing is not None:
            self.routes.prefilled(seqs, bounds, routing)
        return self.model.logits(hidden[to_device([b - 1 for b in bounds[1:]], dev)]).float()

    def _context_of(self, seqs: list[Sequence], bounds: list[int]) -> ContextPrefill | None:
        """Where some sequence continues K/V its blocks hold (a multi-turn episode's next turn):
        every sequence's context slots, so that its new tokens attend to all of it; else None."""
        if all(s.num_cached == 0 for s in seqs):
            return None
        bs = self.block_size
        slots = [to_device([s.block_table[i // bs] * bs + i % bs for i in range(len(s))], self.device)
                 for s in seqs]
        return ContextPrefill(bounds, slots)

    @torch.no_grad()
    def encode_aside(self, observation: Observation) -> tuple[VisionEmbeds, torch.cuda.Event | None]:
        """A multi-turn observation's vision features, encoded on the lowest-priority vision stream
        while the decode steps go on (theirs go first), and the event recorded when they are done,
        which the engine queries before it schedules the observation's prefill. On CPU, at once."""
        q = observation.prompt
        if self.vision_stream is None:
            return self.model.encode_vision(q.pixel_values, q.image_grid_thw, q.pixel_values_videos,
                                            q.video_grid_thw), None
        self.vision_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.vision_stream):
            features = self.model.encode_vision(q.pixel_values, q.image_grid_thw, q.pixel_values_videos,
                                                q.video_grid_thw)
            done = torch.cuda.Event()
            done.record()
        for t in features.tensors():
            t.record_stream(self.caller_stream)  # read by the prefill, on the caller's stream
        return features, done

    def _vision_of(self, seqs: list[Sequence]) -> VisionEmbeds:
        """Vision features of the step's new tokens in token order: a prompt's images are
        encoded the first time it is prefilled and kept; an observation's were encoded when it
        came (`encode_aside`)."""
        parts = []
        for s in seqs:
            p = s.prompt
            if s.num_cached == 0 and p.has_vision:
                if p.vision is None:
                    q = p.request.prompt
                    p.vision = self.model.encode_vision(q.pixel_values, q.image_grid_thw, q.pixel_values_videos,
                                                        q.video_grid_thw)
                parts.append(p.vision)
            parts += [s.observation_vision[i] for i, o in enumerate(s.observations)
                      if s.num_prompt + o.start >= s.num_cached and o.prompt.has_vision]  # not in the blocks yet
        return VisionEmbeds.concat(parts)

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def decode(self, running: DecodeBatch, copies: list[tuple[int, int]]) -> torch.Tensor:
        """Make the step's copy-on-write block copies, then feed one token per running
        sequence (its last, whose KV is not stored yet) -> float32 logits (batch, vocab)."""
        self.cache.copy_blocks(copies)
        batch = len(running)
        self.reserve_rotary(running.max_position)
        inputs = self._decode_inputs(running)
        bucket = self._graph_bucket(batch)
        if bucket is None:
            groups = None if self.cascade is None else self.cascade.step_groups(running)
            routing = Routing() if self.routes is not None else None
            logits = self._decode_eager(*inputs, groups=groups, routing=routing).float()
            self._record_decoded(running, routing)
            return logits
        static = self.static
        self._pad_rows(batch, bucket)
        for name, value in zip(("ids", "positions", "slots", "tables", "lens", "state_rows"), inputs):
            if name == "state_rows" and self.states is None:
                continue  # no layer keeps a recurrent state: nothing reads the rows' slots
            buf = static[name]
            if name == "tables":
                buf[:batch, :value.shape[1]].copy_(value)
                buf[:batch, value.shape[1]:] = self.cache.sink_block
            else:
                buf[:batch].copy_(value)
        if self.cascade is not None:
            self.cascade.fill_graph_buffers(running)
        self.graphs[bucket].replay()
        self._record_decoded(running, self.graph_routing.get(bucket))
        return self.graph_logits[bucket][:batch].float()

    def _record_decoded(self, running: DecodeBatch, routing: Routing | None) -> None:
        """The routes of the step's fed tokens (a graph's: its first rows), into the generation's log."""
        if routing is not None:
            lengths = running.step_inputs(self.block_size).lengths
            self.routes.decoded(running.device_rows, lengths, routing)

    def _graph_bucket(self, batch: int) -> int | None:
        """The bucket whose graph a step of `batch` rows replays, captured now if this is its
        first use; None where the step decodes eagerly: graphs off, a batch past every bucket,
        or a bucket whose capture ran out of memory."""
        if not self.use_cuda_graphs or batch > self.max_num_seqs:
            return None
        if self.addresses_may_have_moved:
            if self.addresses() != self.captured:
                self._drop_graphs()
            self.addresses_may_have_moved = False
        bucket = next(b for b in self.buckets if b >= batch)
        if bucket not in self.graphs and bucket not in self.eager_buckets:
            self._capture(bucket, batch)
        return bucket if bucket in self.graphs else None

    def reserve_rotary(self, num_positions: int) -> None:
        """A rotary table of at least `num_positions` text positions: at first of
        max_model_len, every position of a sequence whose prompt's rope delta is <= 0
        (text, images); longer when a prompt (a video's) needs it, which a CUDA graph
        sees as a moved address (recaptured at the next generate's check)."""
        if self.rotary_table is None or len(self.rotary_table) < num_positions:
            self.rotary_table = self.model.text_rotary_table(
                max(num_positions, self.max_model_len), self.device, self.cache.dtype)

    def _decode_inputs(self, running: DecodeBatch) -> tuple[torch.Tensor, ...]:
        """The decode inputs, in running order: token ids, rope positions (one per token:
        generated tokens are text), KV slots of the fed tokens, block tables, context
        lengths and the rows' recurrent state slots (their decode rows). Block tables are as wide as the longest table of the batch (the torch
        path gathers that many blocks); a CUDA graph copies them into its full-width
        static buffer."""
        rows, step = running.device_rows, running.step_inputs(self.block_size)
        width = -(-step.longest // self.block_size)
        return (running.last_tokens[rows], step.positions, step.slots, running.block_tables[rows, :width],
                step.lengths.int(), rows)

    def _decode_eager(self, ids, positions, slots, tables, lens, state_rows, cache: KVCache | None = None,
                      states: RecurrentStatePool | None = None, groups: StepGroups | None = None,
                      routing: Routing | None = None) -> torch.Tensor:
        """The decode forward, on the engine's pools or on `cache` and `states` (a graph's captured
        views of them); with `groups` (the rows sharing prompt blocks), group-shared attention;
        with `routing`, the MoE layers' routes kept there."""
        shared_prefix = None if groups is None else groups.attention(tables, lens, self.block_size)
        states = states or self.states
        attn = PagedAttention(cache or self.cache, slots, block_tables=tables, context_lens=lens,
                              backend=self.model.attn_backend, shared_prefix=shared_prefix,
                              layer_ops=self.layer_ops,
                              states=None if states is None else DecodeStates(states, state_rows))
        with_routing(attn, routing)
        rotary = tuple(self.rotary_table[positions].chunk(2, dim=-1))
        return self.model.logits(self.model.forward_generated(ids, rotary, attn))

    # ------------------------------------------------------------------ CUDA graphs

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows past the real batch: write to the sink block, attend to one sink slot."""
        s = self.static
        s["ids"][start:end] = 0
        s["positions"][start:end] = 0
        s["slots"][start:end] = self.cache.sink_block * self.block_size
        s["tables"][start:end] = self.cache.sink_block
        s["lens"][start:end] = 1
        s["state_rows"][start:end] = self.states.sink_row if self.states is not None else 0

    def _drop_graphs(self) -> None:
        """Forget every graph (what they read has moved); each bucket is captured again at its next use,
        those whose capture ran out of memory too: the dropped graphs' memory is given back with them."""
        self.graphs, self.graph_logits, self.graph_routing, self.graph_pool = {}, {}, {}, None
        self.eager_buckets = set()
        self.captured = self.addresses()

    def _make_static_buffers(self) -> None:
        """The graphs' static inputs, once per runner: every graph reads its rows of these."""
        dev, n = self.device, self.max_num_seqs
        self.static = {
            "ids": torch.zeros(n, dtype=torch.long, device=dev),
            "positions": torch.zeros(n, dtype=torch.long, device=dev),
            "slots": torch.zeros(n, dtype=torch.long, device=dev),
            "tables": torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev),
            "lens": torch.ones(n, dtype=torch.int32, device=dev),
            "state_rows": torch.zeros(n, dtype=torch.long, device=dev),
        }

    def _capture(self, bucket: int, batch: int) -> None:
        """Capture the decode graph of one batch-size bucket (first used by a step of `batch`
        rows), into the memory pool the other graphs share (they replay one at a time, on
        the decode stream). The static buffers are padded first: the warm-up and the capture
        run the decode, whose K/V writes must go to the sink block, not to slots of the last
        step's rows (the caller refills the buffers for its step after). A warm-up or capture
        that runs out of memory leaves the bucket eager (`_decode_bucket_eagerly`); any other
        error propagates as it was raised. Failed captures' time counts in `capture_seconds`."""
        start = time.perf_counter()
        if self.static is None:
            self._make_static_buffers()
        self._pad_rows(0, self.max_num_seqs)
        s = self.static
        args = tuple(s[name][:bucket] for name in ("ids", "positions", "slots", "tables", "lens", "state_rows"))
        groups = None if self.cascade is None else self.cascade.graph_groups(bucket)
        routing = Routing() if self.routes is not None else None
        out_of_memory = None
        try:
            # Warm-up: lazy allocations happen outside the capture.
            self._decode_eager(*args, groups=groups, routing=routing)
            self.graphs[bucket], self.graph_logits[bucket] = self._record(args, groups, routing)
            if routing is not None:
                self.graph_routing[bucket] = routing
            self.captures += 1
        except torch.OutOfMemoryError as error:
            # Only its text leaves this block: its traceback holds the failed decode's tensors (some in the
            # partial graph's pool), which go with it, before the cache is emptied.
            out_of_memory = "; ".join([str(error).splitlines()[0], *getattr(error, "__notes__", ())])
        self.capture_seconds += time.perf_counter() - start
        if out_of_memory is not None:
            self._decode_bucket_eagerly(bucket, batch, out_of_memory)

    def _record(self, args: tuple[torch.Tensor, ...], groups: StepGroups | None,
                routing: Routing | None) -> tuple[torch.cuda.CUDAGraph | _EagerGraph, torch.Tensor]:
        """The decode graph over the static inputs `args` (and the cascade's `groups`), and its
        static output: a CUDA graph, or the stand-in on CPU. With `routing`, the MoE layers'
        routes are static outputs too, kept there."""
        if self.device.type != "cuda":
            graph = _EagerGraph(self, args, groups, routing)
            return graph, graph.out
        # On the decode stream itself, without torch.cuda.graph's device synchronize and cache emptying
        # first: a bucket may be first used mid-rollout, with prompt work queued on the side stream.
        # thread_local: another thread's CUDA calls (the data prefetcher's pinned copies) stay allowed.
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.graph_pool, capture_error_mode="thread_local")
        try:
            logits = self._decode_eager(*args, groups=groups, routing=routing)
        except BaseException as error:
            _end_interrupted_capture(graph, error)
            raise
        graph.capture_end()
        self.graph_pool = graph.pool()
        return graph, logits

    def _decode_bucket_eagerly(self, bucket: int, batch: int, out_of_memory: str) -> None:
        """After a capture ran out of memory: give the cached memory back (on CUDA), say so,
        and decode `bucket` eagerly from now on, without capturing it again (until `_drop_graphs`)."""
        self.capture_failures += 1
        self.eager_buckets.add(bucket)
        if self.device.type == "cuda":
            free_then, total = torch.cuda.mem_get_info(self.device)
            torch.cuda.empty_cache()
            free_now = torch.cuda.mem_get_info(self.device)[0]
            free = (f"{free_then / 2**30:.2f} GiB of {total / 2**30:.2f} GiB was free on the device, "
                    f"{free_now / 2**30:.2f} GiB after emptying the cache")
        else:
            free = "free device memory is not measured on CPU"
        warnings.warn(f"the CUDA graph of decode batch-size bucket {bucket} (first used by a step of {batch} "
                      f"sequences) ran out of memory while capturing ({out_of_memory}); {free}. Bucket {bucket} "
                      "now decodes eagerly (slower) until the graphs are captured again")

    def addresses(self) -> GraphAddresses:
        """What a graph captured now would read by address: the KV pool and the state pool
        (elsewhere once released and allocated again, or grown), every weight (the trainer's
        gathered weights may land elsewhere after each update) and the rotary table. Checked
        once per generate()."""
        states = (None if self.states is None else
                  (PoolGeometry.of(self.states.conv), PoolGeometry.of(self.states.recurrent)))
        return GraphAddresses(PoolGeometry.of(self.cache.data), self.weight_addresses(), self.rotary_table.data_ptr(),
                              states)

    def weight_addresses(self) -> tuple[int, ...]:
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return tuple(local_tensor(t).data_ptr() for t in tensors)


@contextlib.contextmanager
def _switched_to(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the enclosed work on `stream` (None: where it is, as on CPU), after the current
    stream's earlier work and before its later work."""
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


def _end_interrupted_capture(graph: torch.cuda.CUDAGraph, error: BaseException) -> None:
    """End a capture that `error` interrupted, so that the decode stream leaves capture mode.
    Ending it may fail too (a capture invalidated by the failure); `error` stays the one
    raised, with that failure as a note (what `add_note` does; Python 3.10 has no add_note)."""
    try:
        graph.capture_end()
    except Exception as end_error:
        error.__notes__ = [*getattr(error, "__notes__", ()), f"ending the interrupted CUDA graph capture failed "
                                                               f"too: {type(end_error).__name__}: {end_error}"]


class _EagerGraph:
    """A CUDA graph's stand-in on CPU, replaying what was captured as a graph does:
    the decode on the same static inputs into the same static output, through the
    pool geometry, the weights and the rotary table of capture time. A graph kept
    across a pool of another geometry at the same address reads the wrong slots
    here as on a GPU; one whose pool, weights or rotary table have moved (on a GPU:
    reads of freed memory) is an error. So the runner's buffer filling, padding, bucket choice and recapture
    rule run, and are tested, unchanged."""

    def __init__(self, runner: ModelRunner, inputs: tuple[torch.Tensor, ...], groups: StepGroups | None,
                 routing: Routing | None = None):
        self.runner, self.inputs, self.groups, self.routing = runner, inputs, groups, routing
        self.captured = runner.addresses()
        self.out = self._run()

    def replay(self) -> None:
        self.out.copy_(self._run())

    def _run(self) -> torch.Tensor:
        runner = self.runner
        if runner.weight_addresses() != self.captured.weights:
            raise RuntimeError("stale CUDA graph: the weights moved since capture; "
                               "on a GPU it would read the old (freed or stale) weights")
        if runner.rotary_table.data_ptr() != self.captured.rotary_table:
            raise RuntimeError("stale CUDA graph: the rotary table moved since capture; "
                               "on a GPU it would read the old (freed) table")
        pool = self.captured.pool.laid_on(runner.cache.data)
        states = None
        if runner.states is not None:
            conv, recurrent = self.captured.states
            states = runner.states.with_data(conv.laid_on(runner.states.conv),
                                             recurrent.laid_on(runner.states.recurrent))
        return runner._decode_eager(*self.inputs, cache=runner.cache.with_data(pool), states=states,
                                    groups=self.groups, routing=self.routing)
