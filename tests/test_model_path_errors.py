"""A wrong model.path fails at once with one error naming model.path, the path and what the folder lacks; the
model folder is read only from disk, never from the hub."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest

from rollplex.data.processor import load_processor
from rollplex.models import from_pretrained
from rollplex.models.protocol import CheckpointError


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """A connection attempt fails at once: a hub lookup cannot wait on the network, and ends in another error."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model folder's files must be read without the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def _copy_without(tiny_dir: Path, folder: Path, *names: str) -> Path:
    shutil.copytree(tiny_dir, folder, ignore=lambda _, files: [f for f in files if f in names])
    return folder


def test_a_missing_folder_or_a_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^model.path {re.escape(str(tmp_path / 'nope'))}: no such folder$"):
        load_processor(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"model.path .*config.json: a file, not a folder; give the folder "
                                              rf"that holds it \({re.escape(str(tmp_path))}\)"):
        load_processor(tmp_path / "config.json")


def test_a_hub_id_is_not_downloaded_but_named_with_the_download_command(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    with pytest.raises(CheckpointError, match=r"^model.path Qwen/Qwen2.5-VL-3B-Instruct: no local folder.*hub id.*"
                                              r"huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct --local-dir"):
        load_processor("Qwen/Qwen2.5-VL-3B-Instruct")
    # A local folder of that name is a model folder like any other.
    shutil.copytree(tiny_dir, tmp_path / "Qwen" / "Qwen2.5-VL-3B-Instruct")
    assert load_processor("Qwen/Qwen2.5-VL-3B-Instruct").tokenizer is not None


def test_a_folder_that_is_not_a_model_lists_what_it_lacks_and_holds(tiny_dir, tmp_path):
    (tmp_path / "Qwen2.5-VL-3B-Instruct").mkdir()  # the parent of the model folder, given by mistake
    with pytest.raises(CheckpointError, match=r"model.path .*: no config.json, no tokenizer.json \(or vocab.json and "
                                              r"merges.txt\), no preprocessor_config.json.*it holds: "
                                              r"Qwen2.5-VL-3B-Instruct/"):
        load_processor(tmp_path)
    no_tokenizer = _copy_without(tiny_dir, tmp_path / "no_tokenizer", "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"no_tokenizer: no tokenizer.json \(or vocab.json and merges.txt\) "
                                              r"\(it holds: .*tokenizer_config.json.*\)$"):
        load_processor(no_tokenizer)
    no_preprocessor = _copy_without(tiny_dir, tmp_path / "no_preprocessor", "preprocessor_config.json")
    with pytest.raises(CheckpointError, match=r"no_preprocessor: no preprocessor_config.json \(it holds: "):
        load_processor(no_preprocessor)


def test_weights_are_looked_for_before_they_load(tiny_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"^model.path .*: no safetensors weights \(model.safetensors"):
        from_pretrained(tiny_dir)  # its tokenizer, processor and config, but no weights
    with pytest.raises(CheckpointError, match=r"^model.path .*nope: no such folder$"):
        from_pretrained(tmp_path / "nope")


def test_transformers_reads_the_folder_with_local_files_only(tiny_dir, monkeypatch):
    from transformers import AutoTokenizer
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    calls = []
    for auto in (AutoTokenizer, AutoImageProcessor):
        load = auto.from_pretrained

        def recording(*args, _load=load, **kwargs):
            calls.append(kwargs.get("local_files_only"))
            return _load(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", recording)
    load_processor(tiny_dir, max_pixels=64 * 28 * 28)  # the image processor loads twice, the second in budget
    assert calls == [True, True, True]


def test_a_run_with_a_wrong_model_path_stops_before_anything_loads(tmp_path):
    from rollplex.config import load_config
    from rollplex.rl.loop import RLTrainer

    with pytest.raises(CheckpointError, match=r"^model.path .*missing_model: no such folder$"):
        RLTrainer(load_config(["--model.path", str(tmp_path / "missing_model"),
                               "--trainer.output_dir", str(tmp_path / "run"), "--logging.no_console"]))
