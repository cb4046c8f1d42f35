"""Multi-turn episodes: what the engine asks of an agentic rollout (rollplex.engine.episodes).

`Agent` is a run's: its tools (rollout.tools, functions) or its environment
(rollout.environment, a class with reset / step), run in worker processes kept across
steps, and how observations are rendered (rollplex.agent.observation). `Agent.episodes`
makes the engine's hook for one generation, `Episodes`, over that generation's rows.

A turn ends where the policy closes a tool call (a token whose text ends with
`</tool_call>`) or samples its end-of-turn token. With tools, the turn's first call is run
(Hermes / Qwen format, rollplex.agent.tools) and its result is the observation; a turn without
a call is the answer, and the episode ends ("stop"). With an environment, every turn is an
action: `step(action)` returns the observation (a user message), a reward and whether the
episode is done. An episode that reaches `rollout.max_turns` policy turns ends ("max_turns")
without running its last call; the environment's last step still runs, for its reward.

A tool that raises, hangs past rollout.tool_timeout_s, returns something that is no
observation or is called wrongly answers with an error message the model reads, counted in
`EpisodeLog.tool_errors`: the run never dies of a tool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from rollplex.agent.environment import EnvironmentRunner, StepResult
from rollplex.agent.observation import ObservationOverLimit, ObservationRenderer
from rollplex.agent.tools import ToolCall, ToolResult, load_tools, parse_tool_call, row_context
from rollplex.agent.workers import ToolFailure, ToolRunner
from rollplex.dist import all_reduce_values
from rollplex.engine.episodes import SampleKey
from rollplex.models.inputs import EpisodeLog, Observation, Sample

if TYPE_CHECKING:
    from rollplex.config import RolloutConfig

# The closing tag of a Hermes / Qwen tool call: a turn ends at a token whose text ends with it.
TOOL_CALL_END = "</tool_call>"


def tool_call_end_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's added tokens whose text ends a tool call (Qwen's `</tool_call>`, 151658)."""
    return frozenset(i for text, i in tokenizer.get_added_vocab().items() if text.endswith(TOOL_CALL_END))


class Agent:
    """A run's multi-turn rollouts: its tools or environment, in worker processes kept for the
    run, and the observation renderer. `tools`: the tool specs (rollout.tools, or a task's)."""

    def __init__(self, rollout: RolloutConfig, processor: Any, rope_spec: Any, tools: list[str]):
        self.config, self.rope_spec = rollout, rope_spec
        self.tokenizer = processor.tokenizer
        self.renderer = ObservationRenderer(processor, rollout.max_observation_tokens)
        self.tools = {t.name: t for t in load_tools(tools)}
        self.tool_runner = ToolRunner(tools, rollout.tool_workers, rollout.tool_timeout_s) if tools else None
        self.environment = (EnvironmentRunner(rollout.environment, rollout.tool_workers, rollout.tool_timeout_s)
                            if rollout.environment else None)
        self.turn_end_ids = tool_call_end_ids(self.tokenizer) if tools else frozenset()
        eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [eos])

    @property
    def schemas(self) -> list[dict]:
        """The tools' schemas, which a prompt's chat template renders."""
        return [t.schema for t in self.tools.values()]

    def episodes(self, examples: list) -> Episodes:
        """The engine's hook for a generation of one request per example, in order."""
        return Episodes(self, examples)

    def close(self) -> None:
        for runner in (self.tool_runner, self.environment):
            if runner is not None:
                runner.close()


@dataclass
class _Episode:
    """One sample's episode in progress."""

    row: Any  # its example (rollplex.data.Example): tools_kwargs, interaction_kwargs
    log: EpisodeLog = field(default_factory=EpisodeLog)  # turns: those begun
    turn_start: int = 0  # response index of the current turn's first token
    response_len: int = 0  # the response's length when the turn ended: where the observation starts
    after_eos: bool = False  # the turn ended with the policy's end-of-turn token (not a tool call's closing tag)
    started_at: float = 0.0  # when its call was submitted
    turn_logged: bool = False  # its current turn is in its messages (it ended)


class Episodes:
    """One generation's episodes (rollplex.engine.episodes.Episodes), by (request, sample)."""

    def __init__(self, agent: Agent, examples: list):
        self.agent, self.examples = agent, examples
        self.turn_end_ids = agent.turn_end_ids
        self.live: dict[SampleKey, _Episode] = {}
        self.ready: list[tuple[SampleKey, ToolResult | ToolFailure]] = []  # answered without a worker
        self.waited_s = 0.0  # time the engine waited on tools with nothing else to run (timing_s/tools)
        self.observations_cut = 0  # observations cut to max_observation_tokens

    def _episode(self, key: SampleKey) -> _Episode:
        if key not in self.live:
            self.live[key] = _Episode(self.examples[key[0]])
            if self.agent.environment is not None:
                self.agent.environment.start(key, dict(self.live[key].row.interaction_kwargs))
        return self.live[key]

    def end_turn(self, key: SampleKey, response: list[int]) -> str | None:
        episode = self._episode(key)
        text = self.agent.tokenizer.decode(response[episode.turn_start:], skip_special_tokens=True)
        episode.log.messages.append({"role": "assistant", "content": text})
        episode.turn_logged = True
        episode.response_len, episode.after_eos = len(response), response[-1] not in self.turn_end_ids
        episode.started_at = time.perf_counter()
        if self.agent.environment is not None:
            self.agent.environment.step(key, text)
            return None
        call = parse_tool_call(text)
        if call is None:
            return "stop"  # no call: the turn is its answer
        if episode.log.turns >= self.agent.config.max_turns:
            return "max_turns"
        episode.log.tool_calls += 1
        context = self._context(call, episode)
        if isinstance(context, str):  # the call cannot be made: the model reads why
            self.ready.append((key, ToolFailure("bad_call", context)))
        else:
            self.agent.tool_runner.submit(key, call, context)
        return None

    def _context(self, call: ToolCall | str, episode: _Episode) -> dict | str:
        """The row's context for the tool `call` names, or why the call cannot be made (it did not parse, names no
        tool, or the row lacks the tool's context)."""
        if isinstance(call, str):
            return call
        tool = self.agent.tools.get(call.name)
        if tool is None:
            return f"there is no tool named {call.name!r} (tools: {', '.join(self.agent.tools)})"
        return row_context(episode.row.tools_kwargs, tool)

    def poll(self, wait: bool) -> list[tuple[SampleKey, Observation | str]]:
        results, self.ready = self.ready, []
        runner = self.agent.environment or self.agent.tool_runner
        if runner is not None and runner.pending():
            start = time.perf_counter()
            results += runner.poll(wait and not results)
            if wait:
                self.waited_s += time.perf_counter() - start
        return [(key, self._outcome(key, result)) for key, result in results]

    def _outcome(self, key: SampleKey, result: ToolResult | StepResult | ToolFailure) -> Observation | str:
        """A finished call's observation for `key`'s episode, or the finish reason it ends with."""
        episode = self.live[key]
        episode.log.seconds += time.perf_counter() - episode.started_at
        if isinstance(result, ToolFailure):
            episode.log.tool_errors += 1
            result = ToolResult(f"Error: {result.message}", [])
        elif isinstance(result, StepResult):
            episode.log.rewards.append(result.reward)
            if result.done:
                return "stop"
            if episode.log.turns >= self.agent.config.max_turns:
                return "max_turns"
            result = result.observation
        role = "user" if self.agent.environment is not None else "tool"
        try:
            rendered = self.agent.renderer.render([result], role=role, after_eos=episode.after_eos)
        except ObservationOverLimit:  # rollout.max_observation_tokens holds not even the template's framing
            return "length"
        self.observations_cut += rendered.truncated
        content = [{"type": "image"}] * (len(result.images) - rendered.dropped_images) + [
            {"type": "text", "text": result.text}]
        episode.log.messages.append({"role": role, "content": content})
        observation = Observation.of(rendered.prompt, episode.response_len, self.agent.rope_spec, rendered.text)
        episode.turn_start, episode.turn_logged = observation.end, False
        episode.log.turns += 1
        return observation

    def finish(self, key: SampleKey, sample: Sample) -> EpisodeLog:
        episode = self.live.pop(key, None)
        if episode is None:  # it never ended a turn (a length limit inside its first)
            episode = _Episode(self.examples[key[0]])
        elif self.agent.environment is not None:
            self.agent.environment.end(key)
        log = episode.log
        if log.turns > len(sample.observations) + 1:  # its last observation did not fit (finish reason "length")
            log.turns -= 1
            log.messages.pop()
        elif not episode.turn_logged:  # cut by a length limit inside a turn: that turn as far as it went
            log.messages.append({"role": "assistant", "content": self.agent.tokenizer.decode(
                sample.token_ids[episode.turn_start:], skip_special_tokens=True)})
        return log


def episode_metrics(samples: list[Sample], tool_wait_s: float, group: dist.ProcessGroup | None) -> dict[str, float]:
    """A step's multi-turn metrics over the dp ranks of `group`: rollout/turns_mean (policy turns per
    sample), rollout/tool_calls_mean, rollout/tool_errors (a sum: calls that raised, timed out, returned
    no observation or did not parse), rollout/observation_tokens_mean, and timing_s/tools (the rollout's
    time waiting on tools with nothing else to decode; the slowest rank's)."""
    logs = [s.episode or EpisodeLog() for s in samples]
    count, turns, calls, errors, observed = all_reduce_values([
        len(samples), sum(e.turns for e in logs), sum(e.tool_calls for e in logs), sum(e.tool_errors for e in logs),
        sum(len(o) for s in samples for o in s.observations)], group=group)
    [waited] = all_reduce_values([tool_wait_s], dist.ReduceOp.MAX, group)
    return {"rollout/turns_mean": turns / count, "rollout/tool_calls_mean": calls / count,
            "rollout/tool_errors": errors, "rollout/observation_tokens_mean": observed / count,
            "timing_s/tools": waited}
