"""PromptDataset: both layouts, JSONL and parquet, skipped rows, resumable batches."""

from __future__ import annotations

import io
import itertools
import json
import re
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.data.datasets import PromptDataset, RowSkipped
from rollplex.data.processing import prepare_prompt


def _image(seed: int, size: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _save_images(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        paths.append(folder / f"img_{i}.png")
        Image.fromarray(_image(i)).save(paths[-1])
    return paths


def test_easyr1_jsonl_relative_paths_and_video(processor, tmp_path):
    images = _save_images(tmp_path / "img", 2)
    frames = tmp_path / "clip"
    frames.mkdir()
    for i in range(4):
        Image.fromarray(_image(10 + i)).save(frames / f"f{i}.png")
    data = _write_jsonl(tmp_path / "train.jsonl", [
        {"problem": "<image> what colour is the shape ?", "answer": "red", "images": ["img/img_0.png"]},
        {"problem": "<image><image> how many ?", "answer": 2, "images": [str(images[0]), "img/img_1.png"]},
        {"problem": "<video> which direction does the dot move ?", "answer": "left", "videos": "clip"},
        {"problem": "<video> which direction ?", "answer": "up",
         "videos": [f"clip/f{i}.png" for i in range(4)]},
    ])  # fmt: skip
    ds = PromptDataset(str(data), processor, max_prompt_length=256)
    assert len(ds) == 4 and ds.sources[0].layout == "easyr1"
    examples = list(ds)
    assert [e.answer for e in examples] == ["red", "2", "left", "up"]
    assert [e.index for e in examples] == [0, 1, 2, 3]
    # Relative paths resolve against the data file's folder, not the working directory.
    ref = prepare_prompt(processor, "<image> what colour is the shape ?", images=[_image(0)])
    assert torch.equal(examples[0].prompt.input_ids, ref.input_ids)
    assert torch.equal(examples[0].prompt.pixel_values, ref.pixel_values)
    assert examples[1].prompt.image_grid_thw.shape == (2, 3)
    # A frame folder and the list of its frames are the same video.
    assert examples[2].prompt.video_grid_thw.tolist() == [[2, 4, 4]]
    assert torch.equal(examples[2].prompt.pixel_values_videos, examples[3].prompt.pixel_values_videos)
    assert ds.skipped == {}


def test_verl_layout_and_custom_columns(processor, tmp_path):
    _save_images(tmp_path / "img", 1)
    verl = _write_jsonl(tmp_path / "verl.jsonl", [
        {"prompt": [{"role": "system", "content": "you are a helpful assistant ."},
                    {"role": "user", "content": "<image> what colour is the shape ?"}],
         "images": [{"path": "img/img_0.png", "bytes": None}],
         "reward_model": {"style": "rule", "ground_truth": "blue"}, "data_source": "x"},
    ])  # fmt: skip
    ds = PromptDataset([verl], processor, max_prompt_length=256)
    assert ds.sources[0].layout == "verl"
    (example,) = list(ds)
    assert example.answer == "blue" and example.prompt.image_grid_thw.tolist() == [[1, 4, 4]]
    assert example.prompt.text.startswith("<|im_start|>system\nyou are a helpful assistant .")
    custom = _write_jsonl(tmp_path / "custom.jsonl", [
        {"question": "<image> what colour ?", "label": "green", "pics": ["img/img_0.png"]},
    ])  # fmt: skip
    ds = PromptDataset(custom, processor, 256, format="easyr1", prompt_key="question", answer_key="label",
                       image_key="pics")
    assert ds[0].answer == "green" and ds[0].prompt.pixel_values is not None
    with pytest.raises(ValueError, match=r"custom.jsonl.*cannot tell the dataset layout.*'label'"):
        PromptDataset(custom, processor, 256)


def test_parquet_with_hf_image_dicts(processor, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"problem": "<image> what colour ?", "answer": "red", "images": [{"bytes": _png(_image(0)), "path": "a.png"}]},
        {"problem": "<image> what colour ?", "answer": "blue", "images": [{"bytes": None, "path": "img/img_0.png"}]},
    ]
    _save_images(tmp_path / "img", 1)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    ds = PromptDataset(tmp_path / "train.parquet", processor, max_prompt_length=256)
    a, b = list(ds)
    assert (a.answer, b.answer) == ("red", "blue")
    assert torch.equal(a.prompt.pixel_values, b.prompt.pixel_values)  # same picture, bytes vs path
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="junk.parquet: cannot read parquet"):
        PromptDataset(tmp_path / "junk.parquet", processor, 256)


def test_parquet_without_pyarrow_names_the_extra(processor, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=r"x.parquet.*pip install pyarrow"):
        PromptDataset(tmp_path / "x.parquet", processor, 256)


def test_too_long_and_corrupt_rows_are_skipped_and_counted(processor, tmp_path):
    _save_images(tmp_path / "img", 1)
    good = _png(_image(1))
    (tmp_path / "img" / "broken.png").write_bytes(good[: len(good) // 2])
    data = _write_jsonl(tmp_path / "d.jsonl", [
        {"problem": "<image> what colour ?", "answer": "red", "images": ["img/img_0.png"]},
        {"problem": "<image> " + "the " * 300, "answer": "red", "images": ["img/img_0.png"]},
        {"problem": "<image> what colour ?", "answer": "red", "images": ["img/broken.png"]},
        {"problem": "<image> what colour ?", "answer": "red", "images": []},
        {"problem": "what colour ?", "answer": "blue"},
    ])  # fmt: skip
    ds = PromptDataset(data, processor, max_prompt_length=64)
    with pytest.warns(UserWarning) as caught:
        examples = list(ds)
    assert [e.index for e in examples] == [0, 4]
    assert ds.skipped == {"too_long": 1, "bad_image": 1, "bad_row": 1}
    messages = [str(w.message) for w in caught]
    assert any("d.jsonl, line 2" in m and "max_prompt_length 64" in m for m in messages)
    assert any("line 3" in m and "broken.png" in m for m in messages)
    # Known-bad rows are neither rendered nor counted again.
    assert len(list(ds)) == 2 and ds.skipped == {"too_long": 1, "bad_image": 1, "bad_row": 1}
    with pytest.raises(RowSkipped, match="too_long") as e:
        ds[1]
    assert e.value.reason == "too_long"


def test_a_missing_image_and_a_corrupt_one_are_summed_up_apart_each_with_its_own_cause(processor, tmp_path):
    _save_images(tmp_path / "img", 1)
    (tmp_path / "img" / "corrupt.png").write_bytes(b"not a png at all")
    data = _write_jsonl(tmp_path / "d.jsonl", [
        {"problem": "<image> what colour ?", "answer": "red", "images": ["img/img_0.png"]},
        {"problem": "<image> what colour ?", "answer": "red", "images": ["img/missing.png"]},
        {"problem": "<image> what colour ?", "answer": "red", "images": ["img/corrupt.png"]},
    ])  # fmt: skip
    ds = PromptDataset(data, processor, max_prompt_length=256)
    *firsts, summary = _warnings_while(lambda: list(ds))
    assert ds.skipped == {"bad_image": 2}
    assert len(firsts) == 2 and "line 3" in firsts[1] and "cannot decode image 0" in firsts[1]
    missing, corrupt = summary.splitlines()[1:]
    assert missing.startswith("  bad_image: 1 row (d.jsonl, line 2)") and "missing.png'): no such file" in missing \
        and "check the image paths and data.image_key" in missing
    assert corrupt.startswith("  bad_image: 1 row (d.jsonl, line 3)") and \
        "cannot decode image 0" in corrupt and "corrupt.png" in corrupt and "UnidentifiedImageError" in corrupt \
        and "corrupt or of another type: replace or re-encode them" in corrupt


def _warnings_while(action) -> list[str]:
    """The warnings `action()` gives, each one counted however often its text repeats."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught]


def test_bad_rows_are_summed_up_one_line_per_reason_with_the_setting_that_fixes_it(processor, tmp_path):
    _save_images(tmp_path / "img", 1)
    good = {"problem": "<image> what colour ?", "answer": "red", "images": ["img/img_0.png"]}
    data = _write_jsonl(tmp_path / "d.jsonl", [
        good,
        *[{"problem": "<image> what colour ?", "solution": "red", "images": ["img/img_0.png"]}] * 4,
        *[{"problem": "<image> " + "the " * 100, "answer": "red", "images": ["img/img_0.png"]}] * 3,
        *[{"problem": "<image> what colour ?", "answer": "red", "images": ["img/gone.png"]}] * 3,
        *[{"problem": "<image> what colour ?", "answer": "red", "pictures": ["img/img_0.png"]}] * 3,
    ])  # fmt: skip
    ds = PromptDataset(data, processor, max_prompt_length=64)
    messages = _warnings_while(lambda: list(ds))
    assert ds.skipped == {"bad_row": 7, "too_long": 3, "bad_image": 3}  # counted as ever, each row once
    # One warning at the first row of each reason, then one summary: not one per row.
    *firsts, summary = messages
    assert len(firsts) == 4 and "d.jsonl, line 2: skipping row 1 (bad_row)" in firsts[0]
    assert summary.startswith(f"13 of 14 rows of {data} skipped:")
    lines = summary.splitlines()[1:]
    assert len(lines) == 4
    answer, too_long, image, placeholder = lines
    assert answer.startswith("  bad_row: 4 rows (d.jsonl, line 2; line 3; line 4; ...)")
    assert "column 'answer' (data.answer_key) is missing; the row's columns: ['images', 'problem', 'solution']" \
        in answer and answer.endswith("set data.answer_key to the answer's column")
    assert too_long.startswith("  too_long: 3 rows (d.jsonl, line 6; line 7; line 8)") and \
        "max_prompt_length 64" in too_long and "raise data.max_prompt_length" in too_long
    assert image.startswith("  bad_image: 3 rows") and "gone.png" in image and "data.image_key" in image
    assert placeholder.startswith("  bad_row: 3 rows") and "1 image placeholder(s)" in placeholder \
        and "data.image_key" in placeholder
    assert _warnings_while(lambda: list(ds)) == []  # rows already known are not warned about again


def test_a_file_of_bad_rows_is_one_error_naming_the_setting(processor, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"problem": f"row {i}", "solution": str(i)} for i in range(300)]),
                   tmp_path / "train.parquet")
    ds = PromptDataset(tmp_path / "train.parquet", processor, 64)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError) as error:
        warnings.simplefilter("always")
        next(ds.batches(2, seed=0))
    assert len(caught) == 1  # the first bad row's warning; the error sums up the rest
    assert re.fullmatch(r"no usable rows in .*train.parquet: skipped \{'bad_row': 300\}\n"
                        r"  bad_row: 300 rows \(train.parquet, row \d+; row \d+; row \d+; ...\): "
                        r".*column 'answer' \(data.answer_key\) is missing.*'solution'.*"
                        r"set data.answer_key to the answer's column", str(error.value))
    # The validation files' rows are iterated: the same error.
    with pytest.warns(UserWarning, match="data.answer_key"), pytest.raises(ValueError, match="no usable rows"):
        list(PromptDataset(tmp_path / "train.parquet", processor, 64))


def test_bad_files_name_file_and_line(processor, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        PromptDataset(tmp_path / "missing.jsonl", processor, 256)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "b"}\n\n{"problem": "a", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 3: malformed JSON"):
        PromptDataset(bad, processor, 256)
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list.jsonl, line 1: expected a JSON object"):
        PromptDataset(tmp_path / "list.jsonl", processor, 256)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"d.csv.*\.jsonl, \.json, \.parquet"):
        PromptDataset(tmp_path / "d.csv", processor, 256)
    (tmp_path / "numbers.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"numbers.json: a .json data file holds one array of objects"):
        PromptDataset(tmp_path / "numbers.json", processor, 256)
    with pytest.raises(ValueError, match="format must be one of"):
        PromptDataset(bad, processor, 256, format="sharegpt")


def _text_dataset(tmp_path: Path, processor, n: int, bad: set[int]) -> PromptDataset:
    # Text-only rows keep these tests fast; the "bad" ones are too long.
    rows = [{"problem": ("the " * 100 if i in bad else "") + f"row {i}", "answer": str(i)} for i in range(n)]
    return PromptDataset(_write_jsonl(tmp_path / "rows.jsonl", rows), processor, max_prompt_length=64)


def _indices(stream, k: int) -> list[list[int]]:
    """The row indices of the next `k` batches of a stream."""
    return [[e.index for e in next(stream)] for _ in range(k)]


def test_batches_full_shuffled_resumable_and_cycling(processor, tmp_path):
    n, bad = 10, {2, 7}
    ds = _text_dataset(tmp_path, processor, n, bad)
    with pytest.warns(UserWarning):
        run = _indices(ds.batches(batch_size=3, seed=1), 8)
    assert all(len(b) == 3 for b in run)
    flat = [i for b in run for i in b]
    assert not bad & set(flat)
    # Each epoch holds every good row once, in its own order.
    epoch1, epoch2 = flat[:8], flat[8:16]
    assert sorted(epoch1) == sorted(epoch2) == sorted(set(range(n)) - bad)
    assert epoch1 != epoch2 and epoch1 != sorted(epoch1)
    assert ds.skipped == {"too_long": 2}
    # Same seed, same stream; another seed, another order.
    assert _indices(ds.batches(3, seed=1), 1) == run[:1]
    assert _indices(ds.batches(3, seed=2), 1) != run[:1]
    # Resuming at step 5 gives batches 5, 6, 7, also in a fresh dataset that has not
    # yet seen the bad rows.
    fresh = _text_dataset(tmp_path, processor, n, bad)
    with pytest.warns(UserWarning):
        resumed = _indices(fresh.batches(batch_size=3, seed=1, start_step=5), 3)
    assert resumed == run[5:]
    assert fresh.skipped == {"too_long": 2}
    # Each example knows the pass over the rows it was drawn in (training/epoch), a resumed stream's too; rows
    # read one by one (validation) were drawn in none.
    epochs = [e.epoch for batch in itertools.islice(ds.batches(3, seed=1), 8) for e in batch]
    assert epochs == [0] * 8 + [1] * 8 + [2] * 8
    assert [e.epoch for e in next(fresh.batches(3, seed=1, start_step=5))] == epochs[15:18] == [1, 2, 2]
    assert next(iter(ds)).epoch is None
    # Examples carry their row's answer.
    assert all(e.answer == str(e.index) for e in next(ds.batches(3, seed=1)))


def test_batches_error_when_no_row_is_usable(processor, tmp_path):
    ds = _text_dataset(tmp_path, processor, 3, bad={0, 1, 2})
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"no usable rows.*too_long.: 3"):
        next(ds.batches(2, seed=0))


def test_multiple_files_index_in_order(processor, tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"problem": "c", "answer": "3"}])
    ds = PromptDataset([a, b], processor, 64)
    assert len(ds) == 3 and [e.answer for e in ds] == ["1", "2", "3"] and ds[2].index == 2
    assert Counter(i for batch in _indices(ds.batches(3, seed=0), 2) for i in batch) == {0: 2, 1: 2, 2: 2}
    with pytest.raises(IndexError):
        ds[3]


def test_format_prompt_from_a_string_or_a_file_and_a_system_prompt(processor, tmp_path):
    _save_images(tmp_path / "img", 1)
    data = _write_jsonl(tmp_path / "d.jsonl", [
        {"problem": "<image> what colour is the shape ?", "answer": "red", "images": ["img/img_0.png"]},
    ])  # fmt: skip
    plain = PromptDataset(data, processor, 256)[0].prompt
    formatted = PromptDataset(data, processor, 256, format_prompt="{{ content }} answer in one word .",
                              system_prompt="be brief .")[0].prompt
    assert "user\n<|vision_start|>" in formatted.text and "shape ? answer in one word .<|im_end|>" in formatted.text
    assert formatted.text.startswith("<|im_start|>system\nbe brief .<|im_end|>")
    # The same tokens as the prompt written out by hand: the image stays where the row put it.
    by_hand = prepare_prompt(processor, "<image> what colour is the shape ? answer in one word .",
                             images=[_image(0)], system_prompt="be brief .")
    assert torch.equal(formatted.input_ids, by_hand.input_ids)
    assert torch.equal(formatted.pixel_values, plain.pixel_values)
    # A template file (EasyR1's examples/format_prompt/*.jinja): read, its outer whitespace dropped.
    (tmp_path / "math.jinja").write_text("\n{{ content | trim }}\nthink step by step .\n\n")
    from_file = PromptDataset(data, processor, 256, format_prompt=str(tmp_path / "math.jinja"))[0].prompt
    assert "shape ?\nthink step by step .<|im_end|>" in from_file.text
    assert from_file.text.startswith(plain.text.split("<|im_start|>user")[0])  # the template's default system


def test_format_prompt_on_chat_messages_and_its_errors(processor, tmp_path):
    verl = _write_jsonl(tmp_path / "verl.jsonl", [
        {"prompt": [{"role": "system", "content": "row system ."}, {"role": "user", "content": "what colour ?"}],
         "reward_model": {"ground_truth": "red"}},
        {"prompt": [{"role": "user", "content": "which way ?"}], "reward_model": {"ground_truth": "up"}},
    ])  # fmt: skip
    ds = PromptDataset(verl, processor, 256, format_prompt="{{ content }} think first .", system_prompt="config .")
    own_system, no_system = (e.prompt.text for e in ds)
    assert own_system.startswith("<|im_start|>system\nrow system .")  # the row's own system message is kept
    assert "user\nwhat colour ? think first .<|im_end|>" in own_system
    assert no_system.startswith("<|im_start|>system\nconfig .") and "which way ? think first ." in no_system
    for template, error in [("think step by step .", r"must use \{\{ content \}\}.*uses \[\]"),
                            ("{{ content }} {{ hint }}", r"uses \['content', 'hint'\]"),
                            ("{{ content ", "jinja syntax error on line 1"),
                            (str(tmp_path / "missing.jinja"), "a template file must exist")]:
        with pytest.raises(ValueError, match=error):
            PromptDataset(verl, processor, 256, format_prompt=template)


def test_a_folder_stands_for_its_data_files(processor, tmp_path):
    folder = tmp_path / "geo"
    folder.mkdir()
    _write_jsonl(folder / "b.jsonl", [{"problem": "what colour ?", "answer": "blue"}])
    (folder / "a.json").write_text(json.dumps([{"problem": "what colour ?", "answer": "red"},
                                               {"problem": "what shape ?", "answer": "square"}]))
    (folder / "README.md").write_text("not data")
    ds = PromptDataset([folder], processor, max_prompt_length=256)
    assert [s.path.name for s in ds.sources] == ["a.json", "b.jsonl"]  # sorted; other files passed over
    assert [e.answer for e in ds] == ["red", "square", "blue"]
    (tmp_path / "hub" / "data").mkdir(parents=True)
    (tmp_path / "hub" / "data" / "train-0.parquet").write_bytes(b"PAR1")
    with pytest.raises(FileNotFoundError, match=r"hub holds no data files \(.jsonl, .json, .parquet\); these folders "
                                                r"in it do: .*hub/data"):
        PromptDataset(tmp_path / "hub", processor, 256)


@pytest.mark.parametrize("name, split", [("hiyouga/geometry3k@train", "its 'train' split's files"),
                                         ("hiyouga/geometry3k", "the files of the split you want")])
def test_a_hub_dataset_name_says_how_to_download_it(processor, name, split):
    with pytest.raises(FileNotFoundError) as e:
        PromptDataset(name, processor, 256)
    message = str(e.value)
    assert "Rollplex reads local files only" in message and split in message
    assert "huggingface-cli download --repo-type dataset hiyouga/geometry3k --local-dir data/geometry3k" in message
    with pytest.raises(FileNotFoundError, match="dataset file not found: no/such.jsonl"):
        PromptDataset("no/such.jsonl", processor, 256)  # a data file's name: not taken for a hub dataset
