"""Configuration: one dataclass per section, loaded from YAML, overridden on the command line.

Order of precedence (last wins):

1. dataclass defaults below,
2. a preset (``--preset NAME``, or a top-level ``preset: NAME`` in the YAML file): a YAML file in
   ``rollplex/presets/`` but ``template.yaml``,
3. the YAML file (``--config PATH``; with neither, the tiny CPU demo, ``rollplex/presets/tiny.yaml``),
4. command-line flags with dotted names, parsed by tyro (``--rollout.n 4``), or Hydra-style (``rollout.n=4``).

Command-line syntax (tyro 1.0, ``use_underscores=True``; hyphens are accepted too)::

    --rollout.n 4  --trainer.output_dir runs/x  --trainer.lr 1e-3
    --parallel.freeze_vision            # bool on
    --parallel.no_freeze_vision         # bool off
    --schedule.share_prefix false       # also accepted (rewritten to the flag form)
    --schedule.share_prefix=true
    --data.train_files a.jsonl b.jsonl  # lists take several values
    --data.train_files                  # empty list
    data.train_files=[a.jsonl,b.jsonl]  # Hydra-style key=value (verl, EasyR1): rewritten into the forms above
    data.train_files=a.jsonl  trainer.lr=1e-5  schedule.share_prefix=false

In the YAML file, a string where a list is expected is a list of one (``train_files: a.parquet``), and
``data.reward_kwargs`` may be a mapping (held as its JSON text).

YAML is strict: unknown keys and wrongly typed values raise :class:`ConfigError` naming
the dotted key and the file, so a typo never silently falls back to a default.
"""

from rollplex.config.loader import (TEMPLATE_PATH, TINY_PRESET_PATH, config_from_dict, config_to_dict, load_config,
                                    load_config_file, save_config)
from rollplex.config.sections import (AlgorithmConfig, Config, ConfigError, DataConfig, LoggingConfig, LoRAConfig,
                                      ModelConfig, ParallelConfig, RolloutConfig, ScheduleConfig, TinyModelConfig, TrainerConfig)

__all__ = [
    "ConfigError",
    "TinyModelConfig",
    "ModelConfig",
    "ParallelConfig",
    "LoRAConfig",
    "RolloutConfig",
    "AlgorithmConfig",
    "DataConfig",
    "TrainerConfig",
    "ScheduleConfig",
    "LoggingConfig",
    "Config",
    "TINY_PRESET_PATH",
    "TEMPLATE_PATH",
    "load_config",
    "load_config_file",
    "config_from_dict",
    "config_to_dict",
    "save_config",
]
