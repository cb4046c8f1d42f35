"""Progress inside a step (rollplex.progress): its lines and its live line, on a fake clock and stream; what the
engine and the actor report to it; the end-of-run summary; and what a short run's console shows."""

import io
import re

import pytest
import torch

from rollplex.config import load_config
from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.metrics import MetricsLogger
from rollplex.models import Prompt, build_model
from rollplex.progress import Progress
from rollplex.rl.trainer import build_trainer
from rollplex.train.actor import Actor, ActorConfig
from test_actor import policy_batch
from test_model import tiny_args


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def progress(mode: str, stream: io.StringIO, clock: Clock, every_s: float = 30.0) -> Progress:
    return Progress(mode, every_s, total_steps=100, stream=stream, clock=clock, tick_s=None)


def test_lines_come_every_every_s_while_a_phase_runs_and_say_the_step_phase_counts_and_seconds():
    stream, clock = io.StringIO(), Clock()
    shown = progress("lines", stream, clock, every_s=30)
    shown.start_step(3)
    with shown.phase("gen"):
        shown.generation(1024)
        clock.now += 29
        shown.samples(300, 60_000)
        shown.tick()
        assert stream.getvalue() == ""  # not 30 s into the step yet
        clock.now += 12
        shown.samples(112, 94_710)  # the generation's tokens so far: 2,310 a second over 41 s
        shown.tick()
        shown.tick()  # the next line is due 30 s later
    assert stream.getvalue() == "step 3/100 gen: 412/1,024 samples, 2,310 tok/s (41 s)\n"
    clock.now += 40
    shown.tick()  # between phases: the step's metrics line reports what ran there
    with shown.phase("update_actor"):
        clock.now += 5
        shown.micro_batches(3, 8)
        shown.tick()
    with shown.phase("reward"):
        clock.now += 31
        shown.tick()
    assert stream.getvalue().splitlines()[1:] == ["step 3/100 update_actor: 3/8 micro-batches (5 s)",
                                                  "step 3/100 reward (31 s)"]


def test_the_live_line_is_redrawn_in_place_with_a_bar_and_other_lines_go_above_it():
    terminal, clock = Terminal(), Clock()
    shown = progress("auto", terminal, clock)
    assert shown.mode == "live"
    shown.start_step(7)
    with shown.phase("update_actor"):
        clock.now += 2
        shown.micro_batches(4, 8)
        shown.tick()
        shown.write("step 6/100 | a metrics line")
        shown.micro_batches(8, 8)
        shown.tick()
    drawn = terminal.getvalue()
    assert drawn.startswith("\rstep 7/100 update_actor: ##########           4/8 micro-batches (2 s)")
    assert "\n" not in drawn.split("step 6/100 | a metrics line")[0]  # the live line is redrawn, not printed
    assert "\rstep 6/100 | a metrics line\n" in drawn  # a line of its own, the live line cleared before it
    assert drawn.endswith("\rstep 7/100 update_actor: #################### 8/8 micro-batches (2 s)")
    shown.start_step(8)
    shown.write("step 7/100 | its metrics line")
    redrawn = terminal.getvalue().split("step 7/100 | its metrics line\n")[1]
    assert redrawn.startswith("\rstep 8/100 (0 s)")  # under the line: the step now, not step 7's last phase
    shown.close()
    assert terminal.getvalue().endswith("\r")  # the live line wiped


def test_auto_is_lines_without_a_terminal_and_off_shows_nothing():
    assert progress("auto", io.StringIO(), Clock()).mode == "lines"
    stream, clock = Terminal(), Clock()
    off = progress("off", stream, clock, every_s=1)
    off.start_step(1)
    with off.phase("gen"):
        clock.now += 10
        off.tick()
    off.write("a message")  # the logger's lines still print
    assert stream.getvalue() == "a message\n"
    with pytest.raises(ValueError, match="expected one of auto, live, lines, off"):
        progress("fancy", stream, clock)


def test_a_generation_outside_any_phase_is_a_phase_of_its_own_that_ends_with_it():
    """The engine alone (EngineConfig.progress): 'generate', its line taken away when the generation ends."""
    terminal, clock = Terminal(), Clock()
    shown = Progress("live", stream=terminal, clock=clock, tick_s=None)
    shown.generation(8)
    clock.now += 1
    shown.samples(2, 500)
    shown.tick()
    assert terminal.getvalue().startswith("\rgenerate: #####                2/8 samples, 500 tok/s (1 s)")
    shown.generation_done()
    assert shown.phase_name is None and terminal.getvalue().endswith("\r")
    shown.start_step(1)
    with shown.phase("val"):
        shown.generation(4)
        shown.generation_done()  # inside a named phase: the phase goes on
        assert shown.phase_name == "val" and shown.samples_total == 4


def test_the_engine_reports_every_sample_and_its_tokens():
    model = build_model(tiny_args(), seed=3, init_std=None).eval()
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=40, enforce_eager=True))
    engine.progress = reports = Progress("lines", stream=io.StringIO(), tick_s=None)
    requests = [Request(Prompt(torch.tensor([1, 5, 9, 13])), n=3), Request(Prompt(torch.tensor([3, 7])), n=2)]
    with reports.phase("gen"):
        engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))
        assert (reports.samples_done, reports.samples_total) == (5, 5)
        assert reports.tokens == engine.stats["decode_tokens"] > 0


def test_the_actor_reports_each_micro_batch_of_an_update_and_of_a_logprob_pass():
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-4, max_tokens_per_micro_batch=40)  # several micro-batches
    actor = Actor(model, cfg)
    batch = policy_batch(model, cfg)
    reported = []
    actor.on_micro_batch = lambda done, total: reported.append((done, total))
    actor.update(batch)
    total = reported[-1][1]
    assert total > 1 and reported == [(done, total) for done in range(1, total + 1)]
    reported.clear()
    actor.logprobs(model, batch.groups)
    assert reported == [(done, total) for done in range(1, total + 1)]


def test_the_run_summary_says_the_best_and_final_scores_the_last_checkpoint_and_the_files(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=4) as logger:
        for step, val in ((1, None), (2, 0.5), (3, None), (4, 0.25)):
            logger.log(step, {"critic/score/mean": step / 10} | ({"val/score": val} if val is not None else {}))
        capsys.readouterr()
        logger.summarize_run(4, 4, tmp_path / "checkpoints" / "step_00000004", ("Hugging Face model", tmp_path / "hf"))
    [head, *lines] = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"run complete: step 4/4 in {tmp_path} \(4 step\(s\) in this process, 0:00:0\d\)", head)
    assert lines == ["  val/score 0.25 at step 4 (best 0.5 at step 2)",
                     "  mean reward (critic/score/mean) 0.4 at step 4",
                     f"  last checkpoint: {tmp_path / 'checkpoints' / 'step_00000004'}",
                     f"  Hugging Face model: {tmp_path / 'hf'}",
                     f"  metrics: {tmp_path / 'metrics.jsonl'}"]

    # A resumed run's summary counts the steps before the resume too.
    with MetricsLogger(tmp_path, resumed_step=4, console=False) as logger:
        logger.log(5, {"critic/score/mean": 0.5, "val/score": 0.375})
        assert logger.highlights.best_val == (0.5, 2) and logger.highlights.final_val == (0.375, 5)


def test_a_short_run_shows_its_phases_as_they_run_then_its_summary(tmp_path, capsys):
    build_trainer(load_config([
        "--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4", "--data.val_size", "4",
        "--trainer.num_threads", "1", "--trainer.total_steps", "2", "--trainer.eval_every", "2",
        "--trainer.save_every", "2", "--trainer.save_hf", "true", "--trainer.output_dir", str(tmp_path),
        "--logging.progress", "lines", "--logging.progress_every_s", "0.01"])).fit()
    out = capsys.readouterr().out
    # Lines while the steps ran, every 10 ms of a phase: the phases of both steps, their counts where they have them.
    shown = re.findall(r"^step ([12])/2 (\w+)(?:: (.+))? \(\d+ s\)$", out, re.MULTILINE)
    assert {step for step, _, _ in shown} == {"1", "2"}, out
    assert {phase for _, phase, _ in shown} <= {"gen", "prefix", "reward", "update_actor", "val", "save"}, out
    for _, phase, counts in shown:
        assert not counts or re.fullmatch(r"\d+/\d+ (samples, [\d,]+ tok/s|micro-batches)", counts), out
    summary = out[out.index("run complete: step 2/2"):].splitlines()
    assert summary[1].startswith("  val/score ") and summary[2].startswith("  mean reward (critic/score/mean) ")
    assert summary[3:] == [f"  last checkpoint: {tmp_path / 'checkpoints' / 'step_00000002'}",
                           f"  Hugging Face model: {tmp_path / 'hf'}", f"  metrics: {tmp_path / 'metrics.jsonl'}"]
