"""The decode engine on a tiny random Qwen2.5-VL: exact against transformers and
against full recomputation, prefix sharing, preemption, sampling, bad input, and
group-shared decode attention (rollout.shared_prefix_decode) against plain decode."""

import itertools

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from rollplex.config import RolloutConfig
from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.engine.block_manager import BlockManager
from rollplex.engine.scheduler import Scheduler
from rollplex.models import Prompt, build_model, save_pretrained
from rollplex.models.rope import mrope_positions
from rollplex.engine.cascade import CascadeDecodeAttention, PrefixGroups
from test_model import IMG, VEND, VID, VSTART, image, tiny_args
from test_prefix_sync import HostSyncGuard

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_args(), seed=3, init_std=None).eval()


@pytest.fixture(scope="module")
def hf(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_ckpt")
    save_pretrained(model, path)
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def mixed_requests(n: int = 1) -> list[Request]:
    a, ga, na = image(1, 4, 6, seed=20)
    b, gb, nb = image(1, 8, 4, seed=21)
    v, gv, nv = image(2, 8, 8, seed=22)  # time span (1 step) shorter than the side: see test_model.test_video
    return [
        Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=n),
        Request(Prompt(torch.tensor([3, VSTART] + [IMG] * na + [VEND, 11, 12]), pixel_values=a, image_grid_thw=ga), n=n),
        Request(Prompt(torch.tensor([4, VSTART] + [IMG] * na + [VEND, VSTART] + [IMG] * nb + [VEND, 8]),
                       pixel_values=torch.cat([a, b]), image_grid_thw=torch.cat([ga, gb])), n=n),
        Request(Prompt(torch.tensor([6, 6, VSTART] + [VID] * nv + [VEND, 10]), pixel_values_videos=v, video_grid_thw=gv,
                       second_per_grid_ts=torch.tensor([0.5])), n=n),
    ]


def hf_greedy(hf, r: Request, max_new: int) -> list[int]:
    ids = r.prompt.input_ids[None]
    mm = (ids == IMG).long() + 2 * (ids == VID).long()
    vision = {k: getattr(r.prompt, k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                "video_grid_thw", "second_per_grid_ts") if getattr(r.prompt, k) is not None}
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm, do_sample=False,
                      max_new_tokens=max_new, **vision)
    return out[0, ids.shape[1]:].tolist()


def full_logprobs(model, r: Request, tokens: list[int]) -> torch.Tensor:
    """log-softmax of a full-sequence forward at each generated token."""
    p = r.prompt
    ids = torch.cat([p.input_ids, torch.tensor(tokens)])[None]
    logits = model.hf_forward(ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw,
                              pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw,
                              second_per_grid_ts=p.second_per_grid_ts)[0]
    lp = torch.log_softmax(logits.float(), -1)
    start = len(p.input_ids) - 1
    return lp[start:start + len(tokens)].gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_greedy_equals_transformers_generate(model, hf):
    requests = mixed_requests(n=2)
    outputs = Engine(model, EngineConfig(block_size=4, num_blocks=128)).generate(requests, GREEDY)
    for r, out in zip(requests, outputs):
        expected = hf_greedy(hf, r, GREEDY.max_tokens)
        assert len(out.samples) == 2
        for s in out.samples:
            assert s.token_ids == expected


def test_logprobs_equal_full_sequence_log_softmax(model):
    requests = mixed_requests()
    outputs = Engine(model, EngineConfig(block_size=4, num_blocks=128)).generate(
        requests, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    for r, out in zip(requests, outputs):
        s = out.samples[0]
        ref = full_logprobs(model, r, s.token_ids)
        assert (torch.tensor(s.logprobs) - ref).abs().max() <= 1e-5


def test_long_video_positions_follow_the_reference_rule(model):
    """A video spanning more time steps than its side: the engine's decode positions
    (prompt positions + rope delta) equal a full recompute at every step."""
    v, gv, nv = image(4, 4, 4, seed=23)
    p = Prompt(torch.tensor([2, VSTART] + [VID] * nv + [VEND, 5]), pixel_values_videos=v, video_grid_thw=gv,
               second_per_grid_ts=torch.tensor([2.0]))
    s = Engine(model, EngineConfig(block_size=4, num_blocks=64)).generate([Request(p)], GREEDY)[0].samples[0]
    ids = p.input_ids.tolist()
    for _ in range(GREEDY.max_tokens):
        logits = model.hf_forward(torch.tensor([ids]), pixel_values_videos=v, video_grid_thw=gv,
                                  second_per_grid_ts=p.second_per_grid_ts)
        ids.append(int(logits[0, -1].argmax()))
    assert s.token_ids == ids[len(p.input_ids):]


def test_decode_positions_past_max_model_len_read_a_longer_rotary_table(model):
    """A video spread over more time than its tokens (rope delta > 0) makes decode feed
    rope positions past max_model_len: the runner's table of them grows to fit."""
    v, gv, nv = image(4, 4, 4, seed=23)
    p = Prompt(torch.tensor([2, VSTART] + [VID] * nv + [VEND, 5]), pixel_values_videos=v, video_grid_thw=gv,
               second_per_grid_ts=torch.tensor([20.0]))
    r = Request(p)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_model_len=len(p.input_ids) + 8))
    out = engine.generate([r], SamplingParams(temperature=1.0, max_tokens=8, seed=2, ignore_eos=True))[0]
    _, rope_delta = mrope_positions(p.input_ids, model.args.rope_spec, None, gv, p.second_per_grid_ts)
    assert rope_delta > 0 and len(engine.runner.rotary_table) > engine.max_model_len
    s = out.samples[0]
    assert (torch.tensor(s.logprobs) - full_logprobs(model, r, s.token_ids)).abs().max() <= 1e-5


def test_group_prefills_its_prompt_once(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=128))
    r = mixed_requests()[1]
    r.n = 8
    out = engine.generate([r], SamplingParams(temperature=1.0, max_tokens=5, seed=0, ignore_eos=True))[0]
    assert engine.stats["prefill_tokens"] == len(r.prompt.input_ids)
    assert engine.stats["decode_tokens"] == 8 * 4  # the first token of each sample comes from the prefill
    assert len({tuple(s.token_ids) for s in out.samples}) > 1, "children must sample independently"


def test_small_pool_preempts_and_still_completes_every_request(model):
    requests = mixed_requests(n=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = Engine(model, EngineConfig(block_size=4, num_blocks=256)).generate(requests, params)
    small = Engine(model, EngineConfig(block_size=4, num_blocks=14))
    tight = small.generate(requests, params)  # generate() itself asserts that no block leaked
    assert small.stats["preemptions"] > 0
    for a, b in zip(roomy, tight):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        assert all(s.finish_reason == "length" and len(s.token_ids) == 12 for s in b.samples)


def test_only_sequences_needing_a_block_reach_the_block_manager(model, monkeypatch):
    """A decode step asks the block manager only for the sequences whose next token
    starts a block, or that just joined (a private copy of the group's partial last
    prompt block); every other sequence's KV slot comes from its block-table row."""
    calls_per_step = []
    append_slot, schedule = BlockManager.append_slot, Scheduler.schedule

    def counted(self, block_table, num_tokens):
        calls_per_step[-1] += 1
        return append_slot(self, block_table, num_tokens)

    def scheduled(self):
        calls_per_step.append(0)
        return schedule(self)

    monkeypatch.setattr(BlockManager, "append_slot", counted)
    monkeypatch.setattr(Scheduler, "schedule", scheduled)
    r = Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=8)  # 6 tokens: a full block of 4 and a partial one
    out = Engine(model, EngineConfig(block_size=4, num_blocks=64)).generate(
        [r], SamplingParams(temperature=1.0, max_tokens=9, seed=0, ignore_eos=True))
    # The prefill, then 8 decode steps writing tokens 6 to 13: copy-on-write at 6, new blocks at 8 and 12.
    assert calls_per_step == [0, 8, 0, 8, 0, 0, 0, 8, 0]
    assert all(len(s.token_ids) == 9 for s in out[0].samples)


def test_seeded_sampling_is_reproducible_across_batch_composition(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=256))
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=7, ignore_eos=True)
    requests = mixed_requests(n=2)
    together = engine.generate(requests, params)
    again = engine.generate(requests, params)
    assert [[s.token_ids for s in o.samples] for o in together] == [[s.token_ids for s in o.samples] for o in again]
    other_seed = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=6, seed=8, ignore_eos=True))
    assert [o.samples[0].token_ids for o in other_seed] != [o.samples[0].token_ids for o in together]
    # The first request alone samples what it sampled in the batch: noise depends on seed and position only.
    alone = engine.generate(requests[:1], params)[0]
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in together[0].samples]


def test_top_k_restricts_the_support(model):
    r = Request(Prompt(torch.tensor([1, 2, 3])), n=64)
    out = Engine(model, EngineConfig(block_size=4, num_blocks=256)).generate(
        [r], SamplingParams(temperature=2.0, top_k=3, max_tokens=1, seed=0, ignore_eos=True))[0]
    logits = model.hf_forward(r.prompt.input_ids[None])[0, -1]
    allowed = set(logits.topk(3).indices.tolist())
    firsts = {s.token_ids[0] for s in out.samples}
    assert firsts <= allowed and len(firsts) > 1


def test_stop_tokens_and_eos(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64))
    r = Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])))
    greedy = engine.generate([r], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].samples[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    stopped = engine.generate([r], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    assert stopped.samples[0].token_ids == greedy.token_ids[:first + 1]
    assert stopped.samples[0].finish_reason == "stop"


def test_vision_features_of_a_finished_request_are_returned(model):
    r = mixed_requests()[1]
    out = Engine(model, EngineConfig(block_size=4, num_blocks=64)).generate([r], GREEDY)[0]
    expected = model.encode_vision(r.prompt.pixel_values, r.prompt.image_grid_thw).image
    assert torch.equal(out.vision.image, expected)


def test_release_and_reallocate_the_pool(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64))
    first = engine.generate(mixed_requests()[:1], GREEDY)
    engine.release_kv()
    assert engine.cache.nbytes == 0
    assert engine.generate(mixed_requests()[:1], GREEDY)[0].samples == first[0].samples


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_a_clear_error(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_model_len=32))
    with pytest.raises(ValueError, match="does not fit the model's maximum length 32"):
        engine.generate([Request(Prompt(torch.arange(1, 40)))])
    pv, grid, n = image(1, 4, 4, seed=24)
    with pytest.raises(ValueError, match="does not match its grids"):
        engine.generate([Request(Prompt(torch.tensor([1, VSTART] + [IMG] * n + [VEND]), pixel_values=pv[:-2],
                                        image_grid_thw=grid))])
    with pytest.raises(ValueError, match="n must be >= 1"):
        engine.generate([Request(Prompt(torch.tensor([1, 2])), n=0)])
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Engine(model, EngineConfig(block_size=4, num_blocks=2)).generate([Request(Prompt(torch.arange(1, 7)))], GREEDY)


def test_cuda_graph_bookkeeping_matches_eager(model):
    """Static buffers, padded rows (sink block) and bucket choice, exercised on CPU
    with the runner's eager stand-in for CUDA graphs; the GPU runs the same code."""
    requests = mixed_requests(n=3)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    eager = Engine(model, EngineConfig(block_size=4, num_blocks=256)).generate(requests, params)
    graphed = Engine(model, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=20))
    graphed.runner.use_cuda_graphs = True
    out = graphed.generate(requests, params)
    assert graphed.runner.buckets == [1, 2, 4, 8, 16, 20]
    assert list(graphed.runner.graphs) == [16]  # captured at first use: 9 rows, finishing together
    assert [[s.token_ids for s in o.samples] for o in out] == [[s.token_ids for s in o.samples] for o in eager]
    old_pool = graphed.cache.data  # kept alive, so the new pool lands elsewhere
    graphed.release_kv()  # a new pool: the next generate must recapture against it
    assert [[s.token_ids for s in o.samples] for o in graphed.generate(requests, params)] == \
        [[s.token_ids for s in o.samples] for o in eager]
    assert graphed.cache.data.data_ptr() != old_pool.data_ptr() and graphed.runner.captures == 2


def test_every_generation_runs_on_one_pool(model):
    """The pool is the configured one, allocated once at one address, whatever the batch:
    the decode graphs read it by address."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=40, enforce_eager=True))
    address = engine.cache.data.data_ptr()
    for requests in (mixed_requests(n=2), mixed_requests(n=1)[:1]):
        engine.generate(requests, params)
        assert (engine.cache.data.data_ptr(), engine.cache.num_blocks) == (address, 40)


def test_the_rl_loop_builds_engine_and_sampling_configs_from_its_rollout_section():
    rollout = RolloutConfig(block_size=8, max_num_seqs=5, enforce_eager=True, temperature=0.5, top_p=0.9, top_k=4,
                            max_tokens=7, ignore_eos=True, shared_prefix_decode=True)
    assert EngineConfig.from_config(rollout, num_blocks=12, max_model_len=300) == EngineConfig(
        block_size=8, num_blocks=12, max_num_seqs=5, max_model_len=300, enforce_eager=True, progress=False,
        shared_prefix_decode=True)
    assert SamplingParams.from_config(rollout) == SamplingParams(temperature=0.5, top_p=0.9, top_k=4, max_tokens=7,
                                                                 ignore_eos=True)


@pytest.mark.parametrize("shared_prefix_decode", [False, True])
def test_a_decode_step_makes_the_host_wait_only_for_its_own_tokens(model, monkeypatch, shared_prefix_decode):
    """Between reading two steps' tokens back, the host schedules the next decode step and
    replays its graph (on CPU the stand-in) without waiting for the device: nothing read
    back and host data copied over without blocking (HostSyncGuard: on CPU it records what
    would wait on a GPU). Finishing a step reads its tokens, from pinned memory once its
    copy's event is done, and nothing else."""
    found = {"schedule": [], "issue": [], "finish": []}

    def guarded(name, method):
        def call(self, *args):
            with HostSyncGuard(copies=True) as guard:
                result = method(self, *args)
            found[name].append(guard.calls)
            return result
        return call

    engine = Engine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=256, max_num_seqs=16,
                                        shared_prefix_decode=shared_prefix_decode))
    engine.runner.use_cuda_graphs = True  # the stand-in replays the graph's static buffers as CUDA would
    engine.generate(mixed_requests(n=3), STOPS)  # captures the graphs: once, not a decode step's work
    issue, finish = Engine._issue, Engine._finish
    monkeypatch.setattr(Scheduler, "_schedule_decode", guarded("schedule", Scheduler._schedule_decode))
    monkeypatch.setattr(Engine, "_issue", lambda self, step, *a: (guarded("issue", issue) if not step.is_prefill
                                                                  else issue)(self, step, *a))
    monkeypatch.setattr(Engine, "_finish", lambda self, issued, *a: (guarded("finish", finish)
                                                                     if not issued.step.is_prefill
                                                                     else finish)(self, issued, *a))
    engine.generate(mixed_requests(n=3), STOPS)
    assert engine.stats["graph_captures"] == 0
    assert engine.stats["dropped_tokens"] > 0  # steps ran ahead, rows left mid-flight
    assert len(found["issue"]) > 5
    assert found["schedule"] == [[]] * len(found["schedule"]) and found["issue"] == [[]] * len(found["issue"])
    assert found["finish"] == [["Tensor.numpy"]] * len(found["finish"])


# ----------------------------------------------------------------------------- group-shared decode attention

BLOCK_SIZE = 4
# Samples end at any of these (tokens the tiny model samples at seed 5), so a group shrinks as they finish.
STOPS = SamplingParams(temperature=1.0, max_tokens=12, seed=5, stop_token_ids=[0, 5, 47, 93], ignore_eos=True)
# Every sample runs to 12 tokens: in a small pool, the youngest are preempted and rejoin, recomputed.
FULL_LENGTH = SamplingParams(temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)


def generate_mixed(model, num_blocks: int, params: SamplingParams, **config):
    engine = Engine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, **config))
    return engine, engine.generate(mixed_requests(n=3), params)


def assert_same_samples(a: list, b: list) -> None:
    """The same tokens and finish reasons, and logprobs within 1e-5 (the batches around them may differ)."""
    for x_group, y_group in zip(a, b, strict=True):
        for x, y in zip(x_group.samples, y_group.samples, strict=True):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert (torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max() <= 1e-5


@pytest.mark.parametrize("num_blocks, max_num_seqs, params, preempts",
                         [(256, 256, STOPS, False), (256, 4, STOPS, False), (22, 256, STOPS, True),
                          (14, 256, FULL_LENGTH, True)],
                         ids=["finishing", "waiting-for-rows", "finishing-preempting", "preempting"])
def test_running_ahead_samples_what_finishing_each_step_first_samples(model, monkeypatch, num_blocks, max_num_seqs,
                                                                       params, preempts):
    """With run-ahead the host issues decode step N+1 before it reads step N's tokens
    back: the same samples as reading each step back before the next, the tokens that a
    finished sequence sampled ahead dropped, through stops, preemptions and prompts that
    wait for rows or blocks (which make the engine finish the step in flight first)."""
    events = []
    issue, finish = Engine._issue, Engine._finish
    monkeypatch.setattr(Engine, "_issue", lambda self, step, *a: events.append("issue") or issue(self, step, *a))
    monkeypatch.setattr(Engine, "_finish", lambda self, *a: events.append("finish") or finish(self, *a))
    settled_engine, settled = generate_mixed(model, num_blocks, params, max_num_seqs=max_num_seqs, run_ahead=False)
    assert events == ["issue", "finish"] * (len(events) // 2)
    events.clear()
    ahead_engine, ahead = generate_mixed(model, num_blocks, params, max_num_seqs=max_num_seqs)
    assert_same_samples(settled, ahead)
    unfinished = list(itertools.accumulate(1 if e == "issue" else -1 for e in events))
    assert max(unfinished) == 2  # never more than one step ahead
    # Most steps were issued with the one before still in flight.
    assert sum(u == 2 for u in unfinished) > len(events) // 4
    for engine in (settled_engine, ahead_engine):
        assert (engine.stats["preemptions"] > 0) == preempts
    assert settled_engine.stats["decode_tokens"] == ahead_engine.stats["decode_tokens"]
    assert settled_engine.stats["dropped_tokens"] == 0
    assert ahead_engine.stats["dropped_tokens"] > 0 or params is FULL_LENGTH  # a stop is known a step late


def check_groups_share_their_prefix(groups: PrefixGroups, block_tables: torch.Tensor) -> int:
    """Every member's table starts with its group's prefix blocks (a recomputed sequence,
    whose blocks are its own, is in no group); returns the rows in groups."""
    batch = len(groups.shared_blocks)
    for rows, prefix, tokens in zip(groups.members.tolist(), groups.prefix_tables.tolist(),
                                    groups.prefix_lens.tolist()):
        rows, prefix = [r for r in rows if r < batch], prefix[:tokens // BLOCK_SIZE]
        assert block_tables[rows, :len(prefix)].tolist() == [prefix] * len(rows)
    return int((groups.members < batch).sum())


@pytest.mark.parametrize("num_blocks, params, preempts", [(256, STOPS, False), (22, STOPS, True),
                                                          (14, FULL_LENGTH, True)],
                         ids=["finishing", "finishing-preempting", "preempting"])
def test_engine_samples_the_same_with_shared_prefix_decode(model, monkeypatch, num_blocks, params, preempts):
    rows_in_groups = []
    build = CascadeDecodeAttention.__init__

    def spy(self, groups, block_tables, context_lens, tail_blocks, block_size):
        rows_in_groups.append(check_groups_share_their_prefix(groups, block_tables))
        # The tails span each row's blocks past its shared ones, no more.
        assert tail_blocks == int((-(-context_lens // block_size) - groups.shared_blocks).max())
        build(self, groups, block_tables, context_lens, tail_blocks, block_size)

    monkeypatch.setattr(CascadeDecodeAttention, "__init__", spy)
    _, plain = generate_mixed(model, num_blocks, params, shared_prefix_decode=False)
    assert not rows_in_groups
    engine, shared = generate_mixed(model, num_blocks, params, shared_prefix_decode=True)
    # Steps ran cascaded, and groups lost rows as their samples finished or were preempted.
    assert any(before > after for before, after in zip(rows_in_groups, rows_in_groups[1:]))
    assert (engine.stats["preemptions"] > 0) == preempts
    assert_same_samples(plain, shared)


def test_greedy_with_shared_prefix_decode_equals_transformers(model, hf):
    requests = mixed_requests(n=2)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=128, shared_prefix_decode=True))
    for r, out in zip(requests, engine.generate(requests, GREEDY)):
        expected = hf_greedy(hf, r, GREEDY.max_tokens)
        assert [s.token_ids for s in out.samples] == [expected, expected]


@pytest.mark.parametrize("num_blocks, params, preempts", [(256, STOPS, False), (30, FULL_LENGTH, True)],
                         ids=["finishing", "preempting"])
def test_decode_graphs_sample_the_same_with_shared_prefix_decode(model, monkeypatch, num_blocks, params, preempts):
    """Decode graphs captured with the cascade over static group buffers (on CPU the
    stand-in replays them as captured), refilled as groups change: groups of 5 rows
    cut into 4 + 1 by the group width, shrinking as samples finish or are preempted."""
    requests = mixed_requests(n=5)
    plain = Engine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, enforce_eager=True))
    graphed = Engine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=20,
                                         max_model_len=64, shared_prefix_decode=True))
    graphed.runner.use_cuda_graphs = True  # on CPU: the stand-in
    graphed.runner.cascade.group_width = 4
    fills = []
    fill = graphed.runner.cascade._refill

    def spy(batch, groups):
        fill(batch, groups)
        if groups is not None:
            fills.append(sorted(int(n) for n in (groups.members < batch).sum(1)))

    monkeypatch.setattr(graphed.runner.cascade, "_refill", spy)
    shared = graphed.generate(requests, params)
    assert graphed.runner.captures == len(graphed.runner.graphs) > 1  # each bucket once, at its first use
    # Groups hold at most 4 rows; a piece of 1 row is a group of 5 cut (a single row is no group by itself).
    assert max(map(max, fills)) == 4 and any(1 in pieces for pieces in fills)
    assert any(sum(before) > sum(after) for before, after in zip(fills, fills[1:]))
    assert (graphed.stats["preemptions"] > 0) == preempts
    for a, b in zip(plain.generate(requests, params), shared):
        for x, y in zip(a.samples, b.samples):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert (torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max() <= 1e-5
