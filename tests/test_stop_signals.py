"""How a run stops on a signal (rollplex.stop_signals): SIGTERM during the steps finishes the step under way, a
second one or a Ctrl-C stops at once, the ranks agree on the step to stop at, and a Ctrl-C whose
KeyboardInterrupt Python swallowed (raised inside a finalizer) still stops the run at the next step boundary."""

import os
import signal
import sys
import weakref

import pytest
import torch.distributed as dist

from distributed import run_distributed
from rollplex import stop_signals
from rollplex.stop_signals import Terminated, finishing_steps, handling_stop_signals


def send(number: int) -> None:
    """Deliver a signal to this process; its Python handler runs before os.kill returns to the caller's next
    bytecode (the main thread checks for signals there)."""
    os.kill(os.getpid(), number)


def test_sigterm_during_the_steps_finishes_the_step_and_a_second_one_stops_at_once(capfd, monkeypatch):
    with handling_stop_signals(), finishing_steps(lambda: 7, 10, announce=True, save_on_term=True) as boundary:
        send(signal.SIGTERM)  # no exception: the step goes on
        assert capfd.readouterr().err == ("rollplex: SIGTERM received: finishing step 7, then saving it and "
                                          "stopping (trainer.save_on_term)\n")
        send(signal.SIGTERM)  # the same stop told twice (SLURM signals every process, and torchrun passes it on)
        assert boundary.requested()
        monkeypatch.setattr(stop_signals, "REPEAT_WINDOW_S", 0.0)
        with pytest.raises(Terminated) as stopped:
            send(signal.SIGTERM)  # a later one: at once
    assert stopped.value.saved_step is None


def test_ctrl_c_while_the_step_finishes_stops_at_once():
    with handling_stop_signals(), finishing_steps(lambda: 3, 10, announce=False, save_on_term=True):
        send(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGINT)


def test_sigterm_stops_at_once_outside_the_steps_and_without_save_on_term():
    with handling_stop_signals():
        with pytest.raises(Terminated):
            send(signal.SIGTERM)  # set-up, evaluation before the first step, the end of the run
        with finishing_steps(lambda: 1, 10, announce=True, save_on_term=False) as boundary:
            with pytest.raises(Terminated):
                send(signal.SIGTERM)
            assert pytest.raises(Terminated, boundary.requested)  # and it stays recorded
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers before come back


def test_a_ctrl_c_swallowed_by_a_finalizer_is_raised_at_the_next_step_boundary(monkeypatch):
    """Python runs finalizers and weakref callbacks wherever the garbage collector or a last reference drop
    happens; a KeyboardInterrupt raised inside one is printed as "Exception ignored" and lost. The handler
    records it, and the step boundary raises it again."""
    class Resource:
        pass

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    with handling_stop_signals(), finishing_steps(lambda: 2, 10, announce=False, save_on_term=True) as boundary:
        resource = Resource()
        weakref.finalize(resource, send, signal.SIGINT)
        del resource  # the finalizer runs here, and the Ctrl-C lands inside it
        [ignored] = unraisable  # Python printed "Exception ignored in: <finalize ...>" and went on
        assert isinstance(ignored.exc_value, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            boundary.requested()


def test_the_record_outlives_the_run_for_its_end_line_but_not_into_a_later_run():
    with pytest.raises(KeyboardInterrupt), handling_stop_signals() as received:
        send(signal.SIGINT)
    assert isinstance(received.signal_that_stopped(RuntimeError("a save that failed")), KeyboardInterrupt)
    with finishing_steps(lambda: 1, 10, announce=False, save_on_term=True) as boundary:  # a trainer fitted later
        assert not boundary.requested()


def _agree_on_the_step(rank: int, world: int) -> None:
    with handling_stop_signals(), finishing_steps(lambda: 1, 10, announce=False, save_on_term=True) as boundary:
        assert not boundary.requested()  # nobody asked
        if rank == 1:
            send(signal.SIGTERM)  # one rank only, as torchrun's forwarding may land before another's boundary
        assert boundary.requested()  # every rank stops at this boundary
    assert dist.get_world_size() == world


def test_the_ranks_agree_to_stop_where_any_rank_got_sigterm():
    run_distributed(_agree_on_the_step, 2)
