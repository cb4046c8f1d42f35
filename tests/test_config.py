"""Tests for rollplex.config: YAML loading, CLI overrides, strict errors, --help."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rollplex.config import (
    TEMPLATE_PATH,
    TINY_PRESET_PATH,
    Config,
    ConfigError,
    DataConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    load_config_file,
    save_config,
)

SECTIONS = ["model", "parallel", "lora", "rollout", "algorithm", "data", "trainer", "schedule", "logging"]


def write_yaml(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# ----------------------------------------------------------------------------- defaults


def test_bare_run_loads_the_tiny_demo_preset():
    raw = yaml.safe_load(TINY_PRESET_PATH.read_text())
    assert list(raw) == [s for s in SECTIONS if s in raw]  # a preset names only the sections it changes

    cfg = load_config([])
    assert cfg.model.path == "" and cfg.model.dtype == "float32"
    assert cfg.rollout.n == 16 and cfg.rollout.max_tokens == 1 and cfg.rollout.temperature == 1.0
    assert cfg.algorithm.entropy_coef == 0.03 and cfg.algorithm.updates_per_batch == 2
    assert cfg.algorithm.kl_coef == 0.0
    assert cfg.data.task == "color" and cfg.data.batch_size == 16 and cfg.data.val_size == 64
    t = cfg.trainer
    assert (t.total_steps, t.lr, t.output_dir) == (500, 1e-4, "runs/tiny")
    assert (t.eval_every, t.save_every, t.num_threads, t.grad_clip) == (50, 50, 1, 1.0)


def test_the_template_lists_every_key_at_its_default():
    """One set of defaults: the real run's template, a file of one's own and --help agree (the demo preset is the
    only file that differs, and only where it says)."""
    raw = yaml.safe_load(TEMPLATE_PATH.read_text())

    def keys(d: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
        return out

    assert list(raw) == SECTIONS
    assert keys(raw) == keys(config_to_dict(Config()))
    assert load_config_file(TEMPLATE_PATH) == Config()
    preset = keys(yaml.safe_load(TINY_PRESET_PATH.read_text()))
    demo, defaults = config_to_dict(load_config([])), config_to_dict(Config())
    differ = {f"{s}.{k}" for s in SECTIONS for k in defaults[s] if demo[s][k] != defaults[s][k]}
    assert differ <= preset  # every other key of the demo is the default


def test_dataclass_defaults_are_a_real_run_s():
    cfg = Config()
    assert cfg.parallel.dp_shard == -1 and cfg.rollout.n == 8 and cfg.trainer.lr == 1e-6
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.max_tokens == 2048 and cfg.rollout.kv_cache_memory == 0
    assert cfg.trainer.save_every > 0 and cfg.trainer.max_tokens_per_micro_batch == 0  # checkpoints; the plan's
    assert cfg.model.tiny == TinyModelConfig()
    assert cfg.data.train_files == [] and cfg.data.train_files is not Config().data.train_files


def test_a_minimal_file_gets_the_defaults_not_the_demo_s(tmp_path):
    path = write_yaml(tmp_path / "mine.yaml", {"data": {"batch_size": 32}, "trainer": {"output_dir": "runs/mine"}})
    cfg = load_config(["--config", str(path)])
    expected = Config()
    expected.data.batch_size, expected.trainer.output_dir = 32, "runs/mine"
    assert cfg == expected


# ----------------------------------------------------------------------------- CLI


def test_cli_overrides_yaml():
    cfg = load_config(["--rollout.n", "4", "--trainer.lr", "0.5"])
    assert cfg.rollout.n == 4 and cfg.trainer.lr == 0.5
    assert cfg.trainer.total_steps == 500  # untouched values still from YAML


def test_cli_syntax_variants():
    cfg = load_config([
        "--trainer.output_dir", "out/x",
        "--rollout.max-tokens", "5",               # hyphens accepted too
        "--model.tiny.hidden_size=32",
        "--data.train_files", "a.jsonl", "b.jsonl",
        "--parallel.freeze_vision",
        "--schedule.no_share_prefix",
        "--logging.no-jsonl",
        "--parallel.dp_shard", "-1",
        "--algorithm.loss_agg_mode", "seq-mean-token-mean",
    ])
    assert cfg.trainer.output_dir == "out/x" and cfg.rollout.max_tokens == 5
    assert cfg.model.tiny.hidden_size == 32
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.parallel.freeze_vision is True
    assert cfg.schedule.share_prefix is False and cfg.logging.jsonl is False
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--schedule.share_prefix", "false"], False),
        (["--schedule.share_prefix", "False"], False),
        (["--schedule.share_prefix=no"], False),
        (["--schedule.share-prefix", "0"], False),
        (["--schedule.no_share_prefix", "--schedule.share_prefix", "true"], True),
        (["--schedule.no_share_prefix", "--schedule.share_prefix=True"], True),
    ],
)
def test_cli_bool_values(args, expected):
    assert load_config(args).schedule.share_prefix is expected


def test_cli_bool_bad_value():
    with pytest.raises(ConfigError, match="share_prefix"):
        load_config(["--schedule.share_prefix=maybe"])


def test_cli_empty_list(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"data": {"train_files": ["x.jsonl"]}})
    assert load_config(["--config", str(path), "--data.train_files"]).data.train_files == []


@pytest.mark.parametrize("args", [["--rollout.n", "0"], ["--model.dtype", "fp8"], ["--rollout.nn", "3"]])
def test_cli_bad_values_exit(args, capsys):
    with pytest.raises(SystemExit) as e:
        load_config(args)
    assert e.value.code != 0


def test_config_flag(tmp_path):
    path = write_yaml(tmp_path / "other.yaml", {"rollout": {"n": 3}, "trainer": {"lr": 2}})
    for argv in (["--config", str(path)], [f"--config={path}"], ["--rollout.top_k", "5", "--config", str(path)]):
        cfg = load_config(argv)
        assert cfg.rollout.n == 3
        assert cfg.trainer.lr == 2.0 and isinstance(cfg.trainer.lr, float)  # int accepted for float
        assert cfg.trainer.total_steps == 100  # not in other.yaml: the dataclass default, not the demo's 500
    assert load_config(["--config", str(path), "--rollout.n", "6"]).rollout.n == 6


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(["--config", str(missing)])
    with pytest.raises(ConfigError, match="needs a path"):
        load_config(["--config"])


# ----------------------------------------------------------------------------- YAML errors


@pytest.mark.parametrize(
    "data, key, valid",
    [
        ({"rollouts": {"n": 2}}, "rollouts", "rollout"),
        ({"rollout": {"nn": 2}}, "rollout.nn", "max_num_seqs"),
        ({"model": {"tiny": {"bogus": 1}}}, "model.tiny.bogus", "vision_depth"),
    ],
)
def test_unknown_key(tmp_path, data, key, valid):
    path = write_yaml(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(path)])
    msg = str(e.value)
    assert f"'{key}'" in msg and str(path) in msg and valid in msg


def test_unknown_key_suggests():
    with pytest.raises(ConfigError, match="Did you mean 'rollout.n'"):
        config_from_dict({"rollout": {"nn": 2}}, "x.yaml")


@pytest.mark.parametrize(
    "data, key, expected",
    [
        ({"rollout": {"n": "eight"}}, "rollout.n", "expected int"),
        ({"rollout": {"n": 2.5}}, "rollout.n", "expected int"),
        ({"rollout": {"n": True}}, "rollout.n", "expected int"),
        ({"trainer": {"lr": "fast"}}, "trainer.lr", "expected float"),
        ({"parallel": {"freeze_vision": "yes please"}}, "parallel.freeze_vision", "expected bool"),
        ({"data": {"train_files": 3}}, "data.train_files", "expected list[str]"),
        ({"data": {"train_files": ["a", 3]}}, "data.train_files[1]", "expected str"),
        ({"model": {"path": None}}, "model.path", "expected str"),
        ({"rollout": 3}, "rollout", "expected a mapping"),
    ],
)
def test_wrong_type(tmp_path, data, key, expected):
    path = write_yaml(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    msg = str(e.value)
    assert key in msg and str(path) in msg and expected in msg


@pytest.mark.parametrize(
    "data, key",
    [
        ({"model": {"dtype": "fp32"}}, "model.dtype"),
        ({"model": {"attn_backend": "xformers"}}, "model.attn_backend"),
        ({"model": {"tiny": {"vocab": "bpe"}}}, "model.tiny.vocab"),
        ({"algorithm": {"adv_estimator": "ppo"}}, "algorithm.adv_estimator"),
        ({"algorithm": {"loss_agg_mode": "sum"}}, "algorithm.loss_agg_mode"),
        ({"algorithm": {"kl_kind": "k4"}}, "algorithm.kl_kind"),
        ({"trainer": {"lr_schedule": "linear"}}, "trainer.lr_schedule"),
        ({"schedule": {"kind": "async"}}, "schedule.kind"),
        ({"data": {"format": "csv"}}, "data.format"),
    ],
)
def test_invalid_choice(data, key):
    with pytest.raises(ConfigError, match=rf"{key}.*one of"):
        config_from_dict(data, "x.yaml")


def test_invalid_choice_direct_construction():
    # __post_init__ validates however the object is built.
    with pytest.raises(ConfigError, match="model.tiny.vocab"):
        TinyModelConfig(vocab="bpe")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rollout.top_p"):
        RolloutConfig(top_p=0.0)


def test_range_error_names_file():
    with pytest.raises(ConfigError, match=r"rollout.n must be >= 2.*x.yaml"):
        config_from_dict({"rollout": {"n": 0}}, "x.yaml")


def test_yaml_float_exponent_and_empty_section(tmp_path):
    # PyYAML alone reads `1e-3` as a string; the loader reads it as a float.
    path = write_yaml(tmp_path / "c.yaml", "trainer:\n  lr: 1e-3\nlogging:\n")
    cfg = load_config_file(path)
    assert cfg.trainer.lr == 1e-3 and cfg.logging == Config().logging


def test_yaml_duplicate_key(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "trainer:\n  lr: 1.0\ntrainer:\n  seed: 3\n")
    with pytest.raises(ConfigError, match="duplicate key 'trainer'"):
        load_config_file(path)


def test_empty_yaml_file(tmp_path):
    assert load_config_file(write_yaml(tmp_path / "c.yaml", "")) == Config()


# ----------------------------------------------------------------------------- help, round trip


def test_help_lists_options_with_descriptions(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # keep option names and descriptions on one line
    with pytest.raises(SystemExit) as e:
        load_config(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for text in [
        "--config PATH",
        "--rollout.n",
        "Responses sampled per prompt",
        "--trainer.output_dir",
        "Directory for checkpoints",
        "--model.tiny.hidden_size",
        "--parallel.freeze_vision",
        "--data.train_files",
        "{grpo,drgrpo}",
    ]:
        assert text in out, text


def test_help_shows_what_a_file_of_one_s_own_gets(capsys, monkeypatch, tmp_path):
    """Bare --help shows the dataclass defaults and names the demo preset's changes; with --config, that file's."""
    monkeypatch.setenv("COLUMNS", "200")

    def help_text(argv: list[str]) -> str:
        with pytest.raises(SystemExit):
            load_config(argv + ["--help"])
        return capsys.readouterr().out

    bare = help_text([])
    assert "(default: 2048)" in bare and "(default: 1)" not in bare.split("--rollout.max_tokens")[1][:400]
    assert "rollout.max_tokens 1" in bare and str(TINY_PRESET_PATH) in bare  # what the bare run changes
    mine = help_text(["--config", str(write_yaml(tmp_path / "m.yaml", {"rollout": {"max_tokens": 77}}))])
    assert "(default: 77)" in mine


def test_dict_round_trip(tmp_path):
    cfg = load_config(["--rollout.n", "3", "--data.train_files", "a", "b", "--model.tiny.vocab", "bytes"])
    d = config_to_dict(cfg)
    assert list(d) == SECTIONS
    assert config_from_dict(d, "dict") == cfg
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(d)), "yaml") == cfg
    save_config(cfg, tmp_path / "sub" / "config.yaml")
    assert load_config_file(tmp_path / "sub" / "config.yaml") == cfg
    assert load_config(["--config", str(tmp_path / "sub" / "config.yaml")]) == cfg


def test_device_option_is_honoured_and_checked():
    from rollplex.dist import init_distributed

    assert init_distributed("cpu")[2].type == "cpu"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        init_distributed("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            init_distributed("cuda")


def test_sections_build_the_components_own_configs():
    """The tiny model's spec and the actor's config are built from the run's sections, one classmethod each."""
    from rollplex.tiny import TinySpec
    from rollplex.train.actor import ActorConfig

    assert TinySpec.from_config(TinyModelConfig()) == TinySpec()
    cfg = config_from_dict({"model": {"tiny": {"hidden_size": 128, "vision_hidden_size": 48, "vocab_size": 1000}},
                            "trainer": {"lr": 1e-3, "grad_clip": 0.5, "max_tokens_per_micro_batch": 0},
                            "algorithm": {"kl_coef": 0.1, "loss_agg_mode": "seq-mean-token-mean"},
                            "rollout": {"max_tokens": 7}, "schedule": {"share_prefix": False}})
    spec = TinySpec.from_config(cfg.model.tiny)
    assert (spec.hidden_size, spec.vocab_size, spec.mrope_section) == (128, 1000, (4, 6, 6))  # head_dim 32
    assert spec.vision_intermediate_size == 96  # 0 in the section: twice the vision width
    actor = ActorConfig.from_config(cfg, micro_batch_tokens=123)  # the memory plan's budget, not the section's 0
    assert (actor.lr, actor.grad_clip, actor.kl_coef, actor.loss_agg_mode) == (1e-3, 0.5, 0.1, "seq-mean-token-mean")
    assert (actor.max_tokens_per_micro_batch, actor.max_response_len, actor.share_prefix) == (123, 7, False)


def test_a_config_saved_with_a_boolean_resume_still_loads():
    """Run folders written before trainer.resume took auto / never / a path hold true or false there."""
    assert config_from_dict({"trainer": {"resume": True}}).trainer.resume == "auto"
    assert config_from_dict({"trainer": {"resume": False}}).trainer.resume == "never"


def test_total_steps_or_total_epochs_the_later_source_decides(tmp_path):
    """One of the two gives the run's length: a source that names only one sets the other to 0, over the
    dataclass defaults (YAML) or over the YAML file (command line); one that gives both nonzero is refused."""
    epochs = load_config(["--trainer.total_epochs", "3"]).trainer  # over the demo preset's total_steps: 500
    assert (epochs.total_steps, epochs.total_epochs) == (0, 3)
    assert load_config(["--trainer.total-epochs=3"]).trainer.total_steps == 0
    assert config_from_dict({"trainer": {"total_epochs": 2}}).trainer.total_steps == 0  # not the default 100
    path = write_yaml(tmp_path / "epochs.yaml", {"trainer": {"total_epochs": 2}})
    steps = load_config(["--config", str(path), "--trainer.total_steps", "7"]).trainer
    assert (steps.total_steps, steps.total_epochs) == (7, 0)
    with pytest.raises(ConfigError, match=r"total_steps 5 and trainer.total_epochs 2: exactly one"):
        config_from_dict({"trainer": {"total_steps": 5, "total_epochs": 2}})
    with pytest.raises(SystemExit):
        load_config(["--trainer.total_steps", "5", "--trainer.total_epochs", "2"])
    with pytest.raises(ConfigError, match="exactly one"):
        TrainerConfig(total_steps=0)


def test_prompt_template_and_system_prompt_need_data_files():
    """The built-in tasks build their own prompts: a template set for them would be silently ignored."""
    for key in ("format_prompt", "system_prompt"):
        with pytest.raises(ConfigError, match=f"data.{key} must be empty without data.train_files"):
            DataConfig(**{key: "{{ content }} think ."})
    assert DataConfig(train_files=["a.jsonl"], format_prompt="{{ content }}", system_prompt="be brief").format_prompt


def test_a_group_of_one_sample_is_refused_naming_why():
    """Both advantage estimators centre each reward on its group's mean: n = 1 would train nothing."""
    with pytest.raises(ConfigError, match=r"rollout.n must be >= 2 .*every advantage is 0.*got 1"):
        RolloutConfig(n=1)
    assert RolloutConfig(n=2).n == 2


# ----------------------------------------------------------------------------- verl / EasyR1 habits


def test_a_string_where_a_list_is_expected_is_a_list_of_one(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "data:\n  train_files: geo/train.parquet\nlora:\n  target_modules: q_proj\n")
    cfg = load_config_file(path)
    assert cfg.data.train_files == ["geo/train.parquet"] and cfg.lora.target_modules == ["q_proj"]


def test_reward_kwargs_take_a_yaml_mapping_and_save_as_json_text(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "data:\n  reward_kwargs:\n    max_response_length: 512\n    mode: strict\n")
    cfg = load_config_file(path)
    assert cfg.data.reward_keyword_arguments() == {"max_response_length": 512, "mode": "strict"}
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config_file(tmp_path / "saved.yaml") == cfg
    on_the_command_line = load_config(["--data.reward_kwargs", '{"max_response_length": 512, "mode": "strict"}'])
    assert on_the_command_line.data.reward_keyword_arguments() == cfg.data.reward_keyword_arguments()


def test_hydra_style_overrides_beside_dashed_options(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"rollout": {"n": 3}})
    cfg = load_config(["data.batch_size=8", "--config", str(path), "trainer.lr=1e-5", "--rollout.top_k", "5",
                       "data.train_files=[a.jsonl, 'b c.jsonl']", "data.val_files=v.jsonl", "schedule.share_prefix=false",
                       "parallel.dp_shard=-1", "rollout.max-tokens=9", "data.system_prompt=answer=42"])
    assert (cfg.data.batch_size, cfg.trainer.lr, cfg.rollout.n, cfg.rollout.top_k) == (8, 1e-5, 3, 5)
    assert cfg.data.train_files == ["a.jsonl", "b c.jsonl"] and cfg.data.val_files == ["v.jsonl"]
    assert cfg.schedule.share_prefix is False and cfg.parallel.dp_shard == -1 and cfg.rollout.max_tokens == 9
    assert cfg.data.system_prompt == "answer=42"
    assert load_config([f"config={path}", "data.train_files=x.jsonl", "data.val_files=[]"]).data.val_files == []
    # The value of the option before it stays a value, though it holds a '='.
    assert load_config(["--data.train_files", "x.jsonl", "--data.system_prompt", "a.b=c"]).data.system_prompt == "a.b=c"


@pytest.mark.parametrize("arg, message", [
    ("data.batchsize=8", r"unknown key 'data.batchsize' in the command line.*Did you mean 'data.batch_size'"),
    ("rollouts.n=3", r"unknown key 'rollouts'.*Did you mean 'rollout'"),
    ("data=3", r"data is a section; set its keys one by one, e.g. data.task="),
    ("rollout.n.x=3", r"rollout.n is a value, not a section"),
])
def test_hydra_style_unknown_keys_are_named_as_in_a_yaml_file(arg, message):
    with pytest.raises(ConfigError, match=message):
        load_config([arg])


def test_a_config_file_starts_from_a_preset(tmp_path):
    tiny = load_config_file(TINY_PRESET_PATH)
    path = write_yaml(tmp_path / "c.yaml", {"preset": "tiny", "rollout": {"n": 4}, "trainer": {"total_epochs": 2},
                                            "logging": None})
    cfg = load_config_file(path)
    assert cfg.rollout.n == 4 and cfg.rollout.max_tokens == tiny.rollout.max_tokens == 1  # the file's, the preset's
    assert (cfg.trainer.total_epochs, cfg.trainer.total_steps) == (2, 0)  # the file's run length, not the preset's
    assert cfg.trainer.lr == tiny.trainer.lr and cfg.model.dtype == "float32"
    save_config(cfg, tmp_path / "run" / "config.yaml")  # a run's saved config: every value, no preset key
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert "preset" not in saved and load_config_file(tmp_path / "run" / "config.yaml") == cfg
    plain = write_yaml(tmp_path / "plain.yaml", {"rollout": {"n": 4}})
    for argv in (["--config", str(plain), "--preset", "tiny"], [f"config={plain}", "preset=tiny"]):
        from_cli = load_config(argv)
        assert from_cli.rollout.n == 4 and from_cli.trainer.total_steps == tiny.trainer.total_steps == 500
    assert load_config(["--preset", "tiny"]) == tiny


def test_a_task_with_a_demo_preset_of_its_own_starts_from_it():
    """`python train.py --data.task look` runs the look demo (rollplex/presets/tiny_look.yaml, over tiny.yaml); a
    config file or --preset given is used as it is."""
    look = load_config(["--data.task", "look"])
    assert (look.rollout.max_tokens, look.data.reward, look.rollout.n) == (18, "look", 16)
    assert load_config(["--data.task=color"]).rollout.max_tokens == 1  # no preset of its own: the tiny demo's
    assert load_config(["--preset", "tiny", "--data.task", "look"]).rollout.max_tokens == 1


def test_an_unknown_preset_lists_the_presets(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown preset 'huge': the presets are tiny, tiny_look \("):
        load_config(["--preset", "huge"])
    with pytest.raises(ConfigError, match=r"unknown preset 'template'"):  # the defaults, not a preset
        load_config_file(write_yaml(tmp_path / "c.yaml", {"preset": "template"}))
    with pytest.raises(ConfigError, match=r"preset in .*c.yaml: expected the name of a preset \(tiny, tiny_look\)"):
        load_config_file(write_yaml(tmp_path / "c.yaml", {"preset": ["tiny"]}))


def test_help_names_the_presets_and_key_value_overrides(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        load_config(["--help"])
    out = capsys.readouterr().out
    assert "--preset NAME" in out and "(tiny, tiny_look)" in out and "preset: NAME" in out and "rollout.n=4" in out


@pytest.mark.parametrize("options, refused", [
    (["--schedule.kind", "disagg", "--schedule.rollout_ranks", "1"], "schedule.kind disagg: its rollout ranks"),
    (["--schedule.kind", "overlap", "--schedule.stream_groups", "true"], "schedule.stream_groups"),
    (["--rollout.tp", "2"], "rollout.tp 2 > parallel.tp 1"),
])
def test_multi_turn_runs_refuse_what_they_cannot_run_yet(options, refused):
    for multi_turn in (["--data.task", "look"], ["--rollout.tools", "tools.py:crop"]):
        with pytest.raises(ConfigError, match=refused):
            load_config(multi_turn + options)
    assert load_config(["--data.task", "look", "--schedule.kind", "overlap"]).multi_turn
