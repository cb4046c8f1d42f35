"""Loading a Config: from a dict or a YAML file (over a preset it names), strictly,
and from the command line (tyro, and Hydra-style key=value) over a YAML file;
saving one as YAML. The rules are the package's (rollplex.config)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from rollplex.config.section import ConfigError, field_types
from rollplex.config.sections import Config

# Files in the package: the presets, among them the tiny CPU demo a bare `python train.py` runs (each names what it
# changes from the dataclass defaults), and the real run's template that lists every key at its default.
PRESETS = Path(__file__).resolve().parents[1] / "presets"
TINY_PRESET_PATH = PRESETS / "tiny.yaml"
TEMPLATE_PATH = PRESETS / "template.yaml"
# The top-level key of a config file that names the preset it starts from (`preset: tiny`).
PRESET_KEY = "preset"
# Fields held as JSON text that a YAML file may also give as a mapping, turned into its JSON text.
JSON_TEXT_FIELDS = ("data.reward_kwargs",)


# --------------------------------------------------------------------------- dict / YAML


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _check_value(value: Any, tp: Any, key: str, source: str) -> Any:
    """Return `value` if it fits type `tp` (ints widened to float), else raise ConfigError."""

    def bad() -> ConfigError:
        got = "null" if value is None else f"{type(value).__name__} {value!r}"
        return ConfigError(f"{key} in {source}: expected {_type_name(tp)}, got {got}")

    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp) or not isinstance(value, str):
            raise bad()
        return value
    if origin is list:
        (elem,) = typing.get_args(tp)
        if elem is str and isinstance(value, str):
            value = [value]  # `train_files: a.parquet`: a list of one
        if not isinstance(value, list):
            raise bad()
        return [_check_value(v, elem, f"{key}[{i}]", source) for i, v in enumerate(value)]
    # bool is a subclass of int: reject it for numeric fields so `n: true` is an error.
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:  # a field type this loader does not know: a bug in this file, not in the YAML
        raise TypeError(f"config field {key} has unsupported type {tp!r}")
    if not ok:
        raise bad()
    return value


def _unknown_key(name: str, cls: type, prefix: str, source: str) -> ConfigError:
    """The error for key `name` of section `prefix` (dataclass `cls`), which has no such field: the valid keys, and
    the closest one."""
    valid = [f.name for f in dataclasses.fields(cls)]
    dotted = f"{prefix}." if prefix else ""
    msg = f"unknown key '{dotted}{name}' in {source}. Valid keys of {prefix or 'top level'}: {', '.join(valid)}"
    if close := difflib.get_close_matches(name, valid, n=1):
        msg += f". Did you mean '{dotted}{close[0]}'?"
    return ConfigError(msg)


def _json_text(value: Any, key: str, source: str) -> Any:
    """A mapping given for a field held as JSON text (JSON_TEXT_FIELDS), as that text; any other value as it is."""
    if not isinstance(value, dict):
        return value
    try:
        return json.dumps(value)
    except TypeError as e:  # a YAML date or set
        raise ConfigError(f"{key} in {source}: the mapping does not convert to JSON ({e})") from None


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    """Construct dataclass `cls` from a mapping, strictly (see module docstring)."""
    if data is None:  # an empty section (`logging:` with everything commented out)
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'top level'} in {source}: expected a mapping, got {type(data).__name__} "
                          f"{data!r}")
    hints = field_types(cls)
    valid = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in valid:
            raise _unknown_key(str(k), cls, prefix, source)
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v, key, source)
        else:
            value = _json_text(v, key, source) if key in JSON_TEXT_FIELDS else v
            kwargs[k] = _check_value(value, tp, key, source)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # range/choice checks in __post_init__: add the file
        raise ConfigError(f"{e} (in {source})") from None


def config_from_dict(d: dict | None, source: str = "<dict>") -> Config:
    """Build a Config from a nested dict (e.g. parsed YAML); missing keys keep defaults.

    `source` names where the dict came from (a file path) in error messages.
    """
    return _build(Config, _run_length_named_once(_upgraded(d)), "", source)


def _upgraded(d: dict | None) -> dict | None:
    """A config saved before trainer.resume took auto / never / a path held a boolean there."""
    trainer = d.get("trainer") if isinstance(d, dict) else None
    if isinstance(trainer, dict) and isinstance(trainer.get("resume"), bool):
        return {**d, "trainer": {**trainer, "resume": "auto" if trainer["resume"] else "never"}}
    return d


# Two ways to give a run's length, one of them 0: a source (the YAML file over the defaults, the command line over
# the YAML file) that names only one of them sets the other to 0, as if it held both.
RUN_LENGTH_KEYS = ("total_steps", "total_epochs")


def _other_run_length(named: set[str]) -> str | None:
    """The run-length key of trainer to set 0, given the trainer keys a source names."""
    given = [k for k in RUN_LENGTH_KEYS if k in named]
    return next(k for k in RUN_LENGTH_KEYS if k not in given) if len(given) == 1 else None


def _run_length_named_once(d: dict | None) -> dict | None:
    trainer = d.get("trainer") if isinstance(d, dict) else None
    other = _other_run_length(set(trainer)) if isinstance(trainer, dict) else None
    return {**d, "trainer": {**trainer, other: 0}} if other else d


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Nested plain dict of `cfg`; `config_from_dict(config_to_dict(cfg)) == cfg`."""
    return dataclasses.asdict(cfg)


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float and rejects duplicate keys.

    PyYAML follows YAML 1.1, where `1e-3` (no dot) is a *string*; in a config that
    would turn `lr: 1e-3` into a type error. Duplicate keys would silently drop the
    first block (e.g. two `trainer:` sections).
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_mapping_no_dups(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise ConfigError(f"duplicate key '{key}'{key_node.start_mark}")
        seen.add(key)
    return loader.construct_mapping(node)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_dups)


def _read_yaml(path: Path) -> Any:
    """The parsed YAML of a config file (ConfigError when it is missing or does not parse)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (resolved: {path.resolve()})")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_YamlLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse YAML in {path}: {e}") from None


def preset_names() -> list[str]:
    """The presets a config starts from by name: the YAML files in rollplex/presets but the template (which holds
    the defaults)."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml") if p != TEMPLATE_PATH)


def preset_path(name: str) -> Path:
    """The file of preset `name` (ConfigError listing the presets when there is none of that name)."""
    if name not in preset_names():
        raise ConfigError(f"unknown preset {name!r}: the presets are {', '.join(preset_names())} (the YAML files in "
                          f"{PRESETS} but the template)")
    return PRESETS / f"{name}.yaml"


def _merged(base: dict, over: dict) -> dict:
    """`over`'s values over `base`'s, section by section (an empty section in `over` changes nothing)."""
    out = dict(base)
    for key, value in over.items():
        below = base.get(key)
        if isinstance(below, dict) and (value is None or isinstance(value, dict)):
            value = _merged(below, value or {})
        out[key] = value
    return out


def _over_preset(data: Any, source: str, preset: str | None) -> Any:
    """A config file's values over those of the preset it starts from: `preset` when given (the command line's
    --preset, over the file's key), else the one its top-level `preset:` key names, if any."""
    if isinstance(data, dict) and PRESET_KEY in data:
        named = data[PRESET_KEY]
        if not isinstance(named, str):
            raise ConfigError(f"{PRESET_KEY} in {source}: expected the name of a preset ({', '.join(preset_names())}),"
                              f" got {named!r}")
        data = {k: v for k, v in data.items() if k != PRESET_KEY}
        preset = preset or named
    if preset is None or not isinstance(data, (dict, type(None))):  # not a mapping: config_from_dict says so
        return data
    # Each file names its own run length (RUN_LENGTH_KEYS): a file that sets total_epochs stops the preset's steps.
    base = _run_length_named_once(_upgraded(_read_yaml(preset_path(preset))))
    return _merged(base, _run_length_named_once(_upgraded(data)) or {})


def load_config_file(path: str | Path, preset: str | None = None) -> Config:
    """Load a YAML config file strictly; missing keys keep the dataclass defaults, or the values of the preset it
    starts from: `preset` when given, else the one its top-level `preset:` key names."""
    path = Path(path)
    return config_from_dict(_over_preset(_read_yaml(path), str(path), preset), str(path))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML that `load_config_file` reads back to an equal Config."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------- command line

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


# The loader's own options, which name no field of Config: each takes a value, and tyro never sees them.
_LOADER_OPTIONS = {"config": "a path: --config PATH", "preset": "a name: --preset NAME"}


def _pop_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove `--NAME VALUE` / `--NAME=VALUE` (one of _LOADER_OPTIONS) from argv: its value and the other args."""
    option, needs = f"--{name}", f"--{name} needs {_LOADER_OPTIONS[name]}"
    value: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == option or a.startswith(option + "="):
            if value is not None:
                raise ConfigError(f"{option} given more than once")
            if a == option:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(needs)
                value = argv[i + 1]
                i += 2
                continue
            value = a.split("=", 1)[1]
            if not value:
                raise ConfigError(needs)
        else:
            rest.append(a)
        i += 1
    return value, rest


# A Hydra-style override, as verl's and EasyR1's command lines give them: data.batch_size=8.
_OVERRIDE = re.compile(r"(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)=(?P<value>.*)", re.DOTALL)
_COMMAND_LINE = "the command line"


def _field_type(dotted: str) -> Any:
    """The type of the Config field a dotted name names; ConfigError, as for a YAML key, when it names none."""
    cls: Any = Config
    prefix = ""
    for name in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"unknown key '{dotted}' on {_COMMAND_LINE}: {prefix} is a value, not a section")
        if name not in {f.name for f in dataclasses.fields(cls)}:
            raise _unknown_key(name, cls, prefix, _COMMAND_LINE)
        cls = field_types(cls)[name]
        prefix = f"{prefix}.{name}" if prefix else name
    if dataclasses.is_dataclass(cls):
        first = dataclasses.fields(cls)[0].name
        raise ConfigError(f"{dotted}=... on {_COMMAND_LINE}: {dotted} is a section; set its keys one by one, e.g. "
                          f"{dotted}.{first}=...")
    return cls


def _list_items(value: str) -> list[str]:
    """A list override's items: [a.jsonl,b.jsonl] (quotes around an item are dropped), [] or a single value."""
    if value.startswith("[") and value.endswith("]"):
        inner = value[1:-1].strip()
        items = [item.strip() for item in inner.split(",")] if inner else []
        return [item[1:-1] if len(item) > 1 and item[0] == item[-1] and item[0] in "'\"" else item for item in items]
    return [value] if value else []


def _takes_value(arg: str) -> bool:
    """Whether `--name` (without =) takes the next arg as its value: a loader option or a field but a bool one."""
    if "=" in arg:
        return False
    name = arg[2:].replace("-", "_")
    if name in _LOADER_OPTIONS:
        return True
    try:
        return _field_type(name) is not bool
    except ConfigError:  # --parallel.no_freeze_vision, --help, or a typo that tyro names
        return False


def _overrides_as_options(args: list[str]) -> list[str]:
    """Turn Hydra-style `key=value` args into tyro's options: `--key=value`, and for a list field `--key item ...`
    (`key=[a,b]` or `key=a`). An arg that is the value of the option before it stays as it is."""
    out: list[str] = []
    is_value = False
    for arg in args:
        override = None if is_value else _OVERRIDE.fullmatch(arg)
        is_value = arg.startswith("--") and _takes_value(arg)
        if override is None:
            out.append(arg)
            continue
        key, value = override["key"].replace("-", "_"), override["value"]
        if key not in _LOADER_OPTIONS and typing.get_origin(_field_type(key)) is list:
            out += [f"--{key}", *_list_items(value)]
        else:
            out.append(f"--{key}={value}")
    return out


def _bool_fields(cls: type = Config, prefix: str = "") -> set[str]:
    """Dotted names of all bool fields, e.g. {'parallel.freeze_vision', ...}."""
    out: set[str] = set()
    for name, tp in field_types(cls).items():
        if name.startswith("_"):
            continue
        dotted = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            out |= _bool_fields(tp, dotted + ".")
        elif tp is bool:
            out.add(dotted)
    return out


def _rewrite_bool_values(args: list[str]) -> list[str]:
    """Turn `--a.b true|false` and `--a.b=false` into tyro's `--a.b` / `--a.no_b` flags.

    tyro 1.0 makes bools either flag pairs (default) or value options
    (FlagConversionOff, which then *requires* a capitalized True/False). Rewriting
    lets both styles work, and lower-case values like in the YAML file.
    """
    bools = _bool_fields()
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, val = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        canon = name.replace("-", "_")
        if canon in bools:
            if eq:
                value: str | None = val
            elif i + 1 < len(args) and args[i + 1].lower() in _TRUE | _FALSE:
                value = args[i + 1]
                i += 1
            else:
                value = None  # plain flag: leave as is
            if value is not None:
                if value.lower() not in _TRUE | _FALSE:
                    raise ConfigError(f"--{name}: expected true or false, got {value!r}")
                section, _, leaf = canon.rpartition(".")
                a = f"--{canon}" if value.lower() in _TRUE else f"--{section}.no_{leaf}"
        out.append(a)
        i += 1
    return out


def _description(source: str | None) -> str:
    if source is None:
        loaded = ("Defaults shown below are the dataclass defaults: a config file of your own gets them for every key\n"
                  f"it leaves out ({TEMPLATE_PATH} lists them all). Without --config, python train.py runs the\n"
                  f"tiny CPU demo, {TINY_PRESET_PATH}, which sets {_preset_values(TINY_PRESET_PATH)}.")
    else:
        loaded = f"Defaults shown below are this run's: the dataclass defaults, then {source}."
    return (
        "rollplex: RL post-training for vision-language models.\n\n"
        "Values come from the dataclass defaults, then a preset, then a YAML file, then command-line options.\n"
        "  --config PATH                       YAML config file (default: the tiny demo preset)\n"
        f"  --preset NAME                       start from a preset ({', '.join(preset_names())}), the file's values\n"
        "                                      over it; in a file: a top-level `preset: NAME`\n"
        "  --rollout.n 4                       set any field by its dotted name\n"
        "  rollout.n=4                         the same, Hydra-style (data.train_files=[a.jsonl,b.jsonl])\n"
        "  --parallel.freeze_vision            bool on  (also: --parallel.freeze_vision true)\n"
        "  --parallel.no_freeze_vision         bool off (also: --parallel.freeze_vision false)\n"
        "  --data.train_files a.jsonl b.jsonl  lists take several values\n\n" + loaded
    )


def _preset_values(path: Path) -> str:
    """The dotted keys and values a preset file sets, e.g. 'rollout.max_tokens 1, trainer.lr 0.0001'."""
    def flat(d: dict, prefix: str = "") -> list[str]:
        return [item for k, v in d.items()
                for item in (flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k} {v}"])]

    return ", ".join(flat(yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader) or {}))


def _task_demo_preset(args: list[str]) -> str | None:
    """The tiny demo's preset for a built-in task named on the command line (`--data.task look`), where the task
    has one of its own (rollplex/presets/tiny_<task>.yaml, over tiny.yaml): what it needs differs from the color
    demo's (a multi-turn answer is longer than one token)."""
    for i, a in enumerate(args):
        task = a.split("=", 1)[1] if a.startswith("--data.task=") else (
            args[i + 1] if a == "--data.task" and i + 1 < len(args) else None)
        if task is not None:
            return f"tiny_{task}" if f"tiny_{task}" in preset_names() else None
    return None


def load_config(argv: list[str] | None = None) -> Config:
    """Load the config: the dataclass defaults, a preset (``--preset NAME``, or the file's ``preset:`` key), a YAML
    file (``--config PATH``; with neither, the tiny demo preset, or with ``--data.task X`` its task's own,
    ``tiny_X``, where there is one), then command-line overrides, ``--key value`` or Hydra-style ``key=value``.

    `argv` defaults to ``sys.argv[1:]``. ``--help`` prints every option and raises SystemExit(0): with the
    values of ``--config PATH`` or ``--preset NAME`` when given, else the dataclass defaults (a user file's, not the
    demo's). A bad command-line value makes tyro print an error and raise SystemExit(2). Errors in the YAML file,
    an unknown preset and an unknown key=value key raise ConfigError.
    """
    import tyro  # imported here so that config_from_dict works without tyro's import cost

    argv = _overrides_as_options(list(sys.argv[1:] if argv is None else argv))
    path, rest = _pop_option(argv, "config")
    preset, rest = _pop_option(rest, "preset")
    asks_help = any(a in ("-h", "--help") for a in rest)
    source: str | None
    if path is None and preset is None and asks_help:
        base, source = Config(), None
    elif path is None:
        preset = preset or _task_demo_preset(rest)
        source = str(preset_path(preset) if preset else TINY_PRESET_PATH)
        base = load_config_file(source)
    else:
        base = load_config_file(path, preset)
        source = f"preset {preset} ({preset_path(preset)}), then {path}" if preset else path
    trainer_options = {a.split("=", 1)[0].removeprefix("--trainer.").replace("-", "_")
                       for a in rest if a.startswith("--trainer.")}
    if other := _other_run_length(trainer_options):
        setattr(base.trainer, other, 0)  # not replace(): the pair is valid only once tyro has set the named one
    cfg = tyro.cli(
        Config,
        args=_rewrite_bool_values(rest),
        default=base,
        use_underscores=True,  # --trainer.output_dir, as in the YAML; hyphens still accepted
        description=_description(source),
    )
    cfg.validate()
    return cfg
