import os
import signal
import sys
from pathlib import Path

import pytest

# Tests import shared helpers from each other (e.g. test_model's tiny config).
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny model folder's tokenizer, processor and config files (read-only: copy it to change them)."""
    from rollplex.tiny import TinySpec, write_tiny_files

    folder = tmp_path_factory.mktemp("tiny_files")
    write_tiny_files(folder, TinySpec())
    return folder


@pytest.fixture(scope="session")
def processor(tiny_dir):
    """The tiny folder's processor, with its own pixel and frame budgets."""
    from rollplex.data.processor import load_processor

    return load_processor(tiny_dir)


@pytest.fixture
def time_limit():
    """Fails a test that hangs rather than hang the suite."""
    def fail(signum, frame):
        raise TimeoutError("the test ran past its 60 s limit")
    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
