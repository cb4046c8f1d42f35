"""The configuration's sections: one dataclass each, its fields documented (the
docstrings are `python train.py --help`'s text), its choices and ranges checked
on construction, whichever way it is built (YAML, command line, code)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rollplex.config.section import ConfigError, Section


# --------------------------------------------------------------------------- sections


@dataclass
class TinyModelConfig(Section):
    """Family and size of the tiny model built from scratch when model.path is empty."""

    _section: ClassVar[str] = "model.tiny"

    family: str = "qwen2_5_vl"
    """Model family: a config.json model_type of rollplex.models.registry.FAMILIES (qwen2_5_vl, qwen3_vl,
    qwen3_vl_moe, qwen3_5, qwen3_5_moe)."""
    hidden_size: int = 64
    """Text decoder hidden size."""
    num_layers: int = 2
    """Text decoder layers."""
    num_heads: int = 4
    """Attention heads of the text decoder."""
    num_kv_heads: int = 2
    """Key/value heads of the text decoder (grouped-query attention)."""
    intermediate_size: int = 128
    """MLP width of the text decoder."""
    vision_hidden_size: int = 32
    """Vision encoder hidden size."""
    vision_depth: int = 2
    """Vision encoder blocks."""
    vision_num_heads: int = 2
    """Vision encoder attention heads."""
    vision_intermediate_size: int = 0
    """Vision encoder MLP width; 0 = 2 x vision_hidden_size (Qwen2.5-VL-3B/7B: 3420)."""
    vocab: Literal["words", "bytes"] = "words"
    """Tokenizer: 'words' = small word-level vocabulary (~64 tokens), 'bytes' = byte-level."""
    vocab_size: int = 0
    """Embedding rows; 0 = the tokenizer's length rounded up to 64. Qwen2.5-VL's 151936 gives the head and
    sampler their real cost (ids past the tokenizer decode to nothing)."""
    num_experts: int = 8
    """MoE families (qwen3_vl_moe, qwen3_5_moe): experts in each MoE layer."""
    num_experts_per_tok: int = 2
    """MoE families: experts each token goes through (top-k)."""
    moe_intermediate_size: int = 48
    """MoE families: each expert's MLP width."""
    tie_word_embeddings: bool = False
    """The LM head reads the embedding matrix (as Qwen2.5-VL-3B does)."""
    seed: int = 0
    """Seed for the random initial weights."""

    def _check_ranges(self) -> None:
        from rollplex.models.registry import FAMILIES

        self._require(self.family in FAMILIES, "family", f"one of {', '.join(FAMILIES)}")
        for name in (
            "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
            "vision_hidden_size", "vision_depth", "vision_num_heads",
        ):
            self._require(getattr(self, name) >= 1, name, ">= 1")
        self._require(self.vision_intermediate_size >= 0, "vision_intermediate_size", ">= 0")
        self._require(self.vocab_size >= 0, "vocab_size", ">= 0")
        self._require(
            self.hidden_size % self.num_heads == 0,
            "hidden_size", f"divisible by num_heads ({self.num_heads})",
        )
        self._require(
            self.num_heads % self.num_kv_heads == 0,
            "num_heads", f"divisible by num_kv_heads ({self.num_kv_heads})",
        )
        self._require(
            self.vision_hidden_size % self.vision_num_heads == 0,
            "vision_hidden_size", f"divisible by vision_num_heads ({self.vision_num_heads})",
        )


@dataclass
class ModelConfig(Section):
    """Which model to train and how to hold it."""

    _section: ClassVar[str] = "model"

    path: str = ""
    """Hugging Face model directory (Qwen2.5-VL or Qwen3-VL; its config.json's model_type says which). Empty: build
    the tiny model (model.tiny) into <trainer.output_dir>/tiny_model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Compute dtype: of the weights forwards and the engine read (FSDP gathers them in it), activations, the KV
    cache and the reference model. The trainer's master weights, gradients and AdamW state stay fp32 (one GPU too)."""
    attn_backend: Literal["auto", "torch", "flash", "flex", "varlen"] = "auto"
    """Attention kernels. torch: SDPA, one call per (query length, key length) of the segments (the reference);
    flash: flash-attn varlen; flex: FlexAttention, one compiled call per layer (CPU: forward only); varlen: torch's
    varlen_attn (CUDA, fp16/bf16). auto = flash when flash-attn is installed on GPU, else torch (flex and varlen
    are not yet measured on a GPU: ask for them by name)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Tiny model built when model.path is empty."""


@dataclass
class ParallelConfig(Section):
    """How the trainer shards the model over ranks."""

    _section: ClassVar[str] = "parallel"

    dp_shard: int = -1
    """FSDP data-parallel shard degree; -1 = world_size // tp."""
    tp: int = 1
    """Tensor-parallel degree of the trainer."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    freeze_vision: bool = False
    """Do not train the vision encoder."""
    offload_optimizer: bool = False
    """Keep optimizer state in host memory."""
    ep: int = 1
    """Expert-parallel degree (MoE models): each group of ep adjacent dp ranks splits every MoE layer's experts
    ep ways (rank r holds experts [r E/ep, (r+1) E/ep)) and sends each token to the rank holding its experts; FSDP
    shards each rank's experts over the dp ranks that hold the same ones. Must divide the dp size and the experts'
    count; 1 = every rank computes every expert."""

    def _check_ranges(self) -> None:
        self._require(self.tp >= 1, "tp", ">= 1")
        self._require(self.dp_shard == -1 or self.dp_shard >= 1, "dp_shard", "-1 or >= 1")
        self._require(self.ep >= 1, "ep", ">= 1")
        self._require(self.dp_shard == -1 or self.dp_shard % self.ep == 0, "ep",
                      f"a divisor of dp_shard ({self.dp_shard}): each expert-parallel group is ep of the dp ranks")
        self._require(self.ep == 1 or self.tp == 1, "ep", "1 when tp > 1 (MoE experts are not split by TP, so MoE "
                      "models train at tp 1)")


@dataclass
class LoRAConfig(Section):
    """Low-rank adapters on a frozen base (rollplex.train.lora). rank 0 trains every weight."""

    _section: ClassVar[str] = "lora"

    rank: int = 0
    """Adapter rank r; 0 = no adapters (full fine-tuning)."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout); the engine runs without it."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layers that get adapters, by name (a layer matches when its dotted name ends with one: q_proj,
    mlp.down_proj); all-linear = every Linear but the LM head."""
    exclude_modules: str = ".*visual.*"
    """Regular expression (matched against the whole dotted name) of layers that get no adapter; the default
    leaves the vision tower without adapters."""
    train_vision: bool = False
    """Train the vision tower's own weights in full (fp32 masters, AdamW) beside the adapters; false freezes
    its weights (it still gets adapters where target_modules reach it and exclude_modules does not)."""

    @property
    def adapters_only(self) -> bool:
        """Adapters are all that trains (rank > 0, the vision tower not trained in full): the whole base is
        frozen, so it loads in the compute dtype, serves as the reference model and exports as a PEFT adapter."""
        return self.rank > 0 and not self.train_vision

    def _check_ranges(self) -> None:
        self._require(self.rank >= 0, "rank", ">= 0 (0 = no adapters)")
        self._require(self.alpha > 0, "alpha", "> 0")
        self._require(0.0 <= self.dropout < 1.0, "dropout", "in [0, 1)")
        self._require(bool(self.target_modules) and all(m.strip() for m in self.target_modules), "target_modules",
                      "one or more layer names (or all-linear)")
        try:
            re.compile(self.exclude_modules)
        except re.error as e:
            raise ConfigError(f"lora.exclude_modules: not a regular expression ({e}): {self.exclude_modules!r}") from None


@dataclass
class RolloutConfig(Section):
    """Generation of responses (the rollout engine)."""

    _section: ClassVar[str] = "rollout"

    n: int = 8
    """Responses sampled per prompt (the GRPO group size); at least 2: both advantage estimators centre each
    reward on its group's mean, so a group of one has advantage 0 and trains nothing."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy. The engine's logprobs and every trainer logprob pass (old, reference,
    actor) and the entropy use logits / temperature, the policy that sampled (at 0: the untempered logits)."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1.0 = off."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    max_tokens: int = 2048
    """Maximum new tokens per response."""
    min_tokens: int = 0
    """0 = every prompt's limit is max_tokens; else each prompt's limit is drawn in [min_tokens, max_tokens] from
    its seed (with ignore_eos: a spread of response lengths, for benchmarks)."""
    ignore_eos: bool = False
    """Generate to the limit even after an end-of-sequence token (benchmarks)."""
    tp: int = 1
    """Tensor-parallel degree of the rollout engine."""
    block_size: int = 16
    """Tokens per paged KV-cache block."""
    kv_cache_memory: float = 0.0
    """The KV pool's capacity: bytes if > 1, else a fraction of the device's memory (trainer.device_memory);
    0 = the memory plan's: what the batch needs at full length, at most what the rollout leaves beside the
    weights and the optimizer state (README, "Memory plan")."""
    max_num_seqs: int = 256
    """Maximum sequences decoded at once."""
    enforce_eager: bool = False
    """Disable CUDA graphs in decoding."""
    shared_prefix_decode: bool = False
    """Decode attention reads each group's shared prompt blocks once per step for all its samples (a Triton
    kernel on CUDA, in the decode graphs too; a torch path on CPU). Off until measured on a GPU (docs/ENGINE.md)."""
    tools: list[str] = field(default_factory=list)
    """Multi-turn rollouts with tools (TRL's tools=): functions as `path/to/file.py:name` or `module:name`; their
    type hints and docstrings are the schema the chat template renders, keyword-only parameters are row context
    (verl's extra_info.tools_kwargs). The model calls one per turn, Hermes / Qwen style
    (<tool_call>{"name": ..., "arguments": {...}}</tool_call>); its text, images or both are the observation.
    Empty: the task's own tools (data.task look), else single-turn."""
    environment: str = ""
    """Multi-turn rollouts with an environment (TRL's environment_factory, verl's interaction): a class
    `path/to/file.py:Name` with reset(**interaction_kwargs) and step(action) -> (observation, reward, done); each
    policy turn is an action, the observation a user message. The rewards reach the reward function."""
    max_turns: int = 8
    """Policy turns per multi-turn episode: a tool call on the last one ends the episode (finish reason max_turns).
    rollout.max_tokens bounds the whole response, observations included."""
    max_observation_tokens: int = 1024
    """A tool's or environment's observation longer than this is cut (text at a token, an image left out whole,
    each with a note the model reads); 0 = no limit but max_tokens."""
    tool_workers: int = 2
    """Worker processes that run tool calls and environments, kept for the run (0 = in the trainer's process:
    no deadline possible)."""
    tool_timeout_s: float = 30.0
    """A tool call or environment step that takes longer is stopped (its worker killed and replaced); the model
    reads an error, counted in rollout/tool_errors."""

    def _check_ranges(self) -> None:
        self._require(self.n >= 2, "n", ">= 2 (GRPO and Dr. GRPO centre each reward on its group's mean: with one "
                      "sample per prompt every advantage is 0 and the policy gradient too)")
        self._require(self.temperature >= 0, "temperature", ">= 0")
        self._require(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        self._require(self.top_k == -1 or self.top_k >= 1, "top_k", "-1 or >= 1")
        self._require(self.max_tokens >= 1, "max_tokens", ">= 1")
        self._require(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "in [0, max_tokens]")
        self._require(self.tp >= 1, "tp", ">= 1")
        self._require(self.block_size >= 1, "block_size", ">= 1")
        self._require(self.kv_cache_memory >= 0, "kv_cache_memory", ">= 0 (0 = the memory plan's)")
        self._require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        self._require(not (self.tools and self.environment), "environment",
                      "empty when rollout.tools is set (an episode's turns go to its tools or to its environment)")
        self._require(self.max_turns >= 1, "max_turns", ">= 1")
        self._require(self.max_observation_tokens >= 0, "max_observation_tokens", ">= 0")
        self._require(self.tool_workers >= 0, "tool_workers", ">= 0")
        self._require(self.tool_timeout_s > 0, "tool_timeout_s", "> 0")


@dataclass
class AlgorithmConfig(Section):
    """The RL objective: advantages, clipping, loss aggregation, regularizers."""

    _section: ClassVar[str] = "algorithm"

    adv_estimator: Literal["grpo", "drgrpo"] = "grpo"
    """Advantage estimator: grpo, or drgrpo (Dr. GRPO: no std normalization)."""
    norm_adv_by_std: bool = True
    """Divide group-centred rewards by the group std (grpo)."""
    clip_low: float = 0.2
    """PPO ratio clip below: 1 - clip_low."""
    clip_high: float = 0.28
    """PPO ratio clip above: 1 + clip_high (DAPO clip-higher)."""
    clip_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are averaged into the batch loss."""
    kl_coef: float = 0.0
    """KL penalty to the reference policy in the loss; 0 = off (no reference model kept)."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    updates_per_batch: int = 4
    """Optimizer steps per rollout batch: its groups are split into this many mini-batches, one step each,
    every sample used once (verl: train_batch_size / ppo_mini_batch_size; not PPO epochs)."""
    recompute_old_logprobs: bool = False
    """Recompute old log-probs with the trainer instead of using the rollout's."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap for the rollout/trainer mismatch; 0 = off."""
    routing_replay: Literal["none", "rollout", "old"] = "none"
    """MoE models: which routes the training forwards replay (the experts are fixed, the weights come from the
    live router). none = each forward routes itself; rollout (R3) = the experts the rollout engine chose for each
    token, in the old, reference and update passes; old (R2) = those of the old-logprob pass, in the update (needs
    recompute_old_logprobs)."""
    moe_aux_loss_coef: float = -1.0
    """MoE models: weight of the load-balancing auxiliary loss (Switch Transformer's) in the update; -1 = the
    checkpoint's router_aux_loss_coef, 0 = off."""

    def _check_ranges(self) -> None:
        self._require(self.moe_aux_loss_coef >= 0 or self.moe_aux_loss_coef == -1, "moe_aux_loss_coef",
                      ">= 0, or -1 (the checkpoint's)")
        self._require(self.routing_replay != "old" or self.recompute_old_logprobs, "routing_replay",
                      "none or rollout unless recompute_old_logprobs is true (old replays the old-logprob pass's "
                      "routes)")
        self._require(self.clip_low >= 0, "clip_low", ">= 0")
        self._require(self.clip_high >= 0, "clip_high", ">= 0")
        self._require(self.clip_c > 1, "clip_c", "> 1")
        self._require(self.kl_coef >= 0, "kl_coef", ">= 0")
        self._require(self.updates_per_batch >= 1, "updates_per_batch", ">= 1")
        self._require(self.tis_cap >= 0, "tis_cap", ">= 0")


@dataclass
class DataConfig(Section):
    """Prompts, images/videos and the reward."""

    _section: ClassVar[str] = "data"

    task: str = "color"
    """Built-in synthetic task, used when train_files is empty."""
    image_size: int = 56
    """Synthetic tasks: side of the image (color) or of each video frame (direction), in pixels."""
    num_frames: int = 4
    """Synthetic direction task: video frames per prompt."""
    train_files: list[str] = field(default_factory=list)
    """Training files (jsonl/parquet); empty = use data.task."""
    val_files: list[str] = field(default_factory=list)
    """Validation files; empty = held-out samples of data.task."""
    format: Literal["auto", "easyr1", "verl"] = "auto"
    """Dataset layout: auto-detect, EasyR1 or verl."""
    prompt_key: str = "problem"
    """Column with the prompt text."""
    answer_key: str = "answer"
    """Column with the reference answer."""
    image_key: str = "images"
    """Column with the images."""
    video_key: str = "videos"
    """Column with the videos."""
    format_prompt: str = ""
    """Prompt template (EasyR1's format_prompt): a jinja file, or else the template itself, rendered with each row's
    prompt as `content`, e.g. '{{ content }} Put the final answer in \\boxed{}.'; chat-message rows: their last user
    message. Data files only; empty = the prompt as it is."""
    system_prompt: str = ""
    """System message of every prompt (a chat-message row with its own keeps it). Data files only; empty = the chat
    template's default."""
    max_prompt_length: int = 2048
    """Longer prompts (in tokens, images included) are dropped."""
    batch_size: int = 128
    """Prompts per step (each gets rollout.n responses)."""
    val_size: int = 64
    """Validation prompts per evaluation."""
    video_fps: float = 2.0
    """Frames per second sampled from videos (at most a video's own rate)."""
    min_pixels: int = 0
    """Least pixels of an image: a smaller one is enlarged, keeping its aspect ratio. 0 = the model folder's
    (preprocessor_config.json)."""
    max_pixels: int = 0
    """Most pixels of an image: a larger one is shrunk, keeping its aspect ratio, so an image gives at most about
    max_pixels / 784 vision tokens (one per 28x28 pixels; Qwen3-VL: max_pixels / 1024, one per 32x32). 0 = the
    model folder's (preprocessor_config.json); lower it against out-of-memory errors."""
    video_max_pixels: int = 0
    """Most pixels of each video frame (a pair of frames gives about video_max_pixels / 784 vision tokens, Qwen3-VL's
    / 1024). 0 = the model folder's (video_preprocessor_config.json, else preprocessor_config.json; Qwen3-VL's
    budgets the whole clip, and this caps each frame below it)."""
    video_max_frames: int = 0
    """Most frames kept per video: a longer video is sampled at a lower rate than video_fps, evenly over its length.
    0 = the model folder's max_frames if it has one, else no cap."""
    reward: str = "exact_match"
    """Reward function: a built-in (exact_match, math, format) or a user function as module:function or
    path/to/file.py:function. Without :function, the module's compute_score (verl's default name), else the one
    public function the module defines."""
    reward_workers: int = -1
    """Worker processes that score rewards in parallel, each kept across steps; a hang or crash in one costs its
    sample (scored 0, counted), not the run. 0 = in the trainer's process, one call after another (no time limit);
    -1 = auto: 0 for a built-in reward, 2 for a user function."""
    reward_timeout_s: float = 60.0
    """Time limit shared by the reward calls that score a step (with schedule.stream_groups: a finished group) in
    worker processes: the responses not scored by then score 0 (counted in reward/timeouts), and the workers still
    in a call are killed and replaced. Calls in the trainer's process (reward_workers 0) cannot be time-limited."""
    reward_kind: Literal["auto", "rollplex", "verl", "easyr1", "easyr1_sequential", "trl"] = "auto"
    """How the reward function is called. auto: from its parameter names. rollplex: fn(response, answer) -> float.
    verl: compute_score(data_source, solution_str, ground_truth, extra_info) -> float or dict. easyr1: batch
    compute_score(reward_inputs: list of dicts) -> list of dicts; easyr1_sequential: compute_score(reward_input) ->
    dict. trl: f(prompts, completions, completion_ids, **columns) -> list of floats."""
    reward_score_key: str = ""
    """The entry of a dict result that is the score; empty = "overall" (EasyR1) or "score" (verl), whichever it has.
    Every number in a dict result is logged as reward/<name>/mean."""
    reward_kwargs: str = ""
    """Keyword arguments for the reward function on every call (verl's custom_reward_function.reward_kwargs, EasyR1's
    reward_function_kwargs): in a YAML file a mapping or a JSON object, on the command line a JSON object, e.g.
    --data.reward_kwargs '{"max_response_length": 512}'. Held as JSON text (a mapping is turned into it); empty =
    none."""
    reward_clip: float = 0.0
    """Clip every reward into [-reward_clip, reward_clip] as it is scored, before the advantages (verl users' guard
    against a reward function's outliers): critic/score, the samples files and val/score show the clipped value; 0 =
    off. A reward that would train beyond 1e6 in magnitude warns once per run."""
    seed: int = 0
    """Seed for shuffling and synthetic data."""

    def _check_ranges(self) -> None:
        self._require(self.max_prompt_length >= 1, "max_prompt_length", ">= 1")
        self._require(self.batch_size >= 1, "batch_size", ">= 1")
        self._require(self.val_size >= 0, "val_size", ">= 0")
        self._require(self.video_fps > 0, "video_fps", "> 0")
        for name in ("min_pixels", "max_pixels", "video_max_pixels", "video_max_frames"):
            self._require(getattr(self, name) >= 0, name, ">= 0 (0 = the model folder's)")
        self._require(not self.max_pixels or self.min_pixels <= self.max_pixels, "min_pixels",
                      f"<= data.max_pixels {self.max_pixels}")
        self._require(self.reward_workers >= -1, "reward_workers", ">= -1 (-1 = auto)")
        self._require(0 < self.reward_timeout_s < float("inf"), "reward_timeout_s", "> 0 and finite")
        self._require(0 <= self.reward_clip < float("inf"), "reward_clip", ">= 0 and finite (0 = off)")
        for name in ("format_prompt", "system_prompt"):
            # The built-in tasks build their own prompts: set there, either would be silently ignored.
            self._require(not getattr(self, name) or bool(self.train_files), name,
                          "empty without data.train_files (the built-in task keeps its prompts)")
        self.reward_keyword_arguments()  # a malformed value stops the run here, not at the first scoring

    def reward_keyword_arguments(self) -> dict[str, Any]:
        """data.reward_kwargs as a dict."""
        if not self.reward_kwargs:
            return {}
        try:
            kwargs = json.loads(self.reward_kwargs)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.reward_kwargs is not JSON ({e}): {self.reward_kwargs!r}") from None
        if not isinstance(kwargs, dict):
            raise ConfigError(f"data.reward_kwargs must be a JSON object, got {self.reward_kwargs!r}")
        return kwargs


@dataclass
class TrainerConfig(Section):
    """Optimization, checkpoints and evaluation."""

    _section: ClassVar[str] = "trainer"

    total_steps: int = 100
    """Training steps (one rollout batch each); 0 = trainer.total_epochs decides."""
    total_epochs: int = 0
    """Passes over data.train_files, instead of total_steps: the run takes ceil(total_epochs x rows / data.batch_size)
    steps. Exactly one of the two is nonzero; a YAML file or command line that sets one sets the other to 0."""
    output_dir: str = "runs/default"
    """Directory for checkpoints, logs and the tiny model; one live run at a time (it holds <output_dir>/run.lock)."""
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = off."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward/backward micro-batch; 0 = the memory plan's: the most tokens whose pass leaves
    the update as much room for kept prompt state as the decode window has, at least one sequence."""
    save_every: int = 50
    """Save a checkpoint every this many steps, and at the last step (the final weights, resumable, exportable
    with tools/export_hf.py); 0 = never."""
    keep_last: int = 2
    """Checkpoints kept on disk; 0 = keep all."""
    save_hf: bool = False
    """At the end of the run, write the final weights as a Hugging Face folder (in model.dtype, with the tokenizer
    and processor files) that transformers loads, to hf_dir; with LoRA, the adapters as a PEFT folder (the merged
    model under lora.train_vision). tools/export_hf.py does the same for any checkpoint (--merged: LoRA merged)."""
    hf_dir: str = ""
    """Where save_hf writes; "" = <output_dir>/hf. Weight files already there are replaced."""
    eval_every: int = 50
    """Evaluate every this many steps; 0 = never."""
    val_before_train: bool = False
    """Evaluate once before the first step of a fresh run, logged as step 0."""
    val_n: int = 1
    """Responses generated per validation prompt; val/score averages them all (verl's val_kwargs.n)."""
    val_temperature: float = 0.0
    """Sampling temperature of validation; 0 = greedy (val_n > 1 then needs a temperature above 0)."""
    val_top_p: float = 1.0
    """Nucleus sampling threshold of validation; 1.0 = off."""
    log_samples_every: int = 10
    """Every this many steps, write log_samples of the step's samples (prompt, response, answer, score, reward
    components, advantage) to <output_dir>/samples/step_N.jsonl; 0 = never. Every evaluation writes all its
    generations there too, whatever this says."""
    log_samples: int = 4
    """Training samples written per such step: one response to each of rank 0's first prompts (then a second each)."""
    seed: int = 0
    """Global seed (torch, sampling)."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    num_threads: int = 0
    """torch CPU threads; 0 = leave torch's default."""
    resume: str = "auto"
    """auto = resume from the latest complete checkpoint in output_dir, if the saved config.yaml agrees on every key
    that changes the run; never = start fresh, refused if output_dir holds checkpoints; or a checkpoint folder
    (output_dir/checkpoints/step_N) to resume from, whatever the saved config says."""
    device_memory: float = 0.0
    """Bytes of one device's memory the memory plan sizes the run within; 0 = the device's own (CUDA: its total
    memory; CPU: the available RAM). On CPU a value stands for a GPU's memory, and each phase's peak live tensor
    bytes are then measured (torch profiler, steps ~3x slower) and logged against the plan."""
    collective_timeout_s: float = 1800.0
    """A collective that waits longer than this for a peer (hung or dead) fails the run instead of hanging it."""
    max_skipped_steps: int = 3
    """Optimizer steps skipped in a row for non-finite logprobs or gradients that stop the run, before it saves the
    step (a save due at a skipped step waits for one that trains: the last checkpoint is a good step's); 0 = never
    stop (each skipped step still prints its cause)."""
    save_on_term: bool = True
    """On SIGTERM (SLURM, Kubernetes, timeout), finish the step under way, save a checkpoint of it and stop; false
    stops at once, as Ctrl-C does, keeping the last checkpoint saved."""

    def _check_ranges(self) -> None:
        for name in ("total_steps", "total_epochs", "warmup_steps", "save_every", "keep_last", "eval_every",
                     "num_threads", "log_samples_every", "log_samples"):
            self._require(getattr(self, name) >= 0, name, ">= 0")
        if (self.total_steps > 0) == (self.total_epochs > 0):
            raise ConfigError(f"trainer.total_steps {self.total_steps} and trainer.total_epochs {self.total_epochs}: "
                              f"exactly one of them gives the run's length, the other must be 0")
        self._require(self.lr >= 0, "lr", ">= 0")
        self._require(self.weight_decay >= 0, "weight_decay", ">= 0")
        self._require(self.grad_clip >= 0, "grad_clip", ">= 0")
        self._require(self.collective_timeout_s > 0, "collective_timeout_s", "> 0")
        self._require(self.max_skipped_steps >= 0, "max_skipped_steps", ">= 0 (0 = never stop)")
        self._require(self.val_n >= 1, "val_n", ">= 1")
        self._require(self.val_temperature >= 0, "val_temperature", ">= 0")
        self._require(0 < self.val_top_p <= 1, "val_top_p", "in (0, 1]")
        self._require(self.val_n == 1 or self.val_temperature > 0, "val_n",
                      "1 when trainer.val_temperature is 0 (greedy responses to one prompt are all the same)")
        self._require(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch",
                      ">= 0 (0 = the memory plan's)")
        self._require(self.device_memory >= 0, "device_memory", ">= 0 (0 = the device's own)")
        self._require(bool(self.resume), "resume", "auto, never or a checkpoint folder")
        # Empty, the run would write its checkpoints, metrics and tiny model into whatever folder it starts in.
        self._require(bool(self.output_dir.strip()), "output_dir", "a folder (runs/<name>, say), not empty")


@dataclass
class ScheduleConfig(Section):
    """How rollout and training share the devices."""

    _section: ClassVar[str] = "schedule"

    kind: Literal["serial", "overlap", "disagg"] = "serial"
    """serial = generate, then the training passes; overlap = prompt work in the decode window (side stream);
    disagg = separate rollout ranks."""
    share_prefix: bool = True
    """Prompt work (vision, reference/actor prompt forwards) once per prompt, not per sample (serial only:
    false is the plain colocated baseline; overlap always shares)."""
    rollout_ranks: int = 0
    """Ranks dedicated to rollout (disagg only)."""
    prefix_memory_budget: float = 0.0
    """Memory for kept prompt state (K/V, graphs): bytes if > 1, else a fraction of the device's memory
    (trainer.device_memory); 0 = the memory plan's, each step: what both the decode window (beside that step's KV
    pool) and the update (beside its micro-batch) can hold. Work that does not fit runs the serial path."""
    stream_groups: bool = False
    """overlap only: a group whose n samples have all finished gets its reward, advantages, reference and old
    logprobs and (first optimizer step's groups) the actor's forward and backward in the decode tail, between
    decode steps, instead of after decode (docs/SCHEDULES.md, "Streaming finished groups")."""

    def _check_ranges(self) -> None:
        self._require(self.rollout_ranks >= 0, "rollout_ranks", ">= 0")
        self._require(not self.stream_groups or self.kind == "overlap", "stream_groups",
                      "false unless schedule.kind is overlap (the decode window is where the groups' work goes)")
        self._require(self.prefix_memory_budget >= 0, "prefix_memory_budget", ">= 0 (0 = the memory plan's)")


@dataclass
class LoggingConfig(Section):
    """Where metrics go."""

    _section: ClassVar[str] = "logging"

    console: bool = True
    """Print metrics to the console."""
    jsonl: bool = True
    """Append metrics to <trainer.output_dir>/metrics.jsonl."""
    tensorboard: bool = False
    """Write TensorBoard events to <trainer.output_dir>/tb."""
    wandb: bool = False
    """Log metrics to Weights & Biases (pip install 'rollplex[wandb]'); files in <trainer.output_dir>/wandb.
    WANDB_MODE=offline keeps the run there without a network (wandb sync uploads it later)."""
    swanlab: bool = False
    """Log metrics to SwanLab (pip install 'rollplex[swanlab]'); files in <trainer.output_dir>/swanlog.
    SWANLAB_MODE=offline (or local) keeps the run there without a network."""
    project: str = "rollplex"
    """wandb / SwanLab project."""
    run_name: str = ""
    """wandb / SwanLab run name; empty = the name of trainer.output_dir's folder."""
    log_every: int = 1
    """Log every this many steps."""
    progress: Literal["auto", "live", "lines", "off"] = "auto"
    """Progress inside a step, on rank 0: live = a display redrawn in place (phase, samples finished, tokens/s,
    the update's micro-batches); lines = a plain line every progress_every_s; auto = live on a terminal, else lines."""
    progress_every_s: float = 30.0
    """Seconds between progress lines (logging.progress lines, or auto without a terminal)."""

    def _check_ranges(self) -> None:
        self._require(self.log_every >= 1, "log_every", ">= 1")
        self._require(self.progress_every_s > 0, "progress_every_s", "> 0")


# The built-in tasks (data.task) whose episodes call tools of their own (rollplex.data.tasks).
TASKS_WITH_TOOLS = ("look",)


@dataclass
class Config:
    """The whole run configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model to train and how to hold it."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the trainer shards the model over ranks."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters on a frozen base (rank 0: full fine-tuning)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation of responses."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL objective."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts, images/videos and the reward."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimization, checkpoints and evaluation."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """How rollout and training share the devices."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where metrics go."""

    def validate(self) -> None:
        """Re-check every section (e.g. after code mutated fields)."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            section.validate()
            for sub in dataclasses.fields(section):
                value = getattr(section, sub.name)
                if isinstance(value, Section):
                    value.validate()
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        if self.lora.rank > 0 and self.schedule.kind == "disagg":
            raise ConfigError("lora.rank > 0 with schedule.kind disagg: the disaggregated rollout ranks hold a "
                              "copy of the weights of their own, which has no adapters yet; use serial or overlap")
        if self.algorithm.routing_replay != "none" and self.schedule.kind != "serial":
            raise ConfigError(f"algorithm.routing_replay {self.algorithm.routing_replay} with schedule.kind "
                              f"{self.schedule.kind}: routing replay runs with the serial schedule for now (the "
                              "kept prompt forwards of overlap and the rollout ranks of disagg do not carry routes "
                              "yet); use schedule.kind serial")
        if self.lora.train_vision and self.parallel.freeze_vision:
            raise ConfigError("lora.train_vision and parallel.freeze_vision both set: the first trains the vision "
                              "tower in full, the second freezes it")
        self._check_expert_parallel()
        self._check_multi_turn()

    @property
    def multi_turn(self) -> bool:
        """Whether the rollout runs multi-turn episodes: tools or an environment, or a task with tools of its own."""
        return bool(self.rollout.tools or self.rollout.environment or
                    (not self.data.train_files and self.data.task in TASKS_WITH_TOOLS))

    def _check_multi_turn(self) -> None:
        """What multi-turn rollouts (rollout.tools / environment) cannot run with yet."""
        if not self.multi_turn:
            return
        what = "rollout.tools" if self.rollout.tools else "rollout.environment" if self.rollout.environment else \
            f"data.task {self.data.task}"
        if self.schedule.kind == "disagg":
            raise ConfigError(f"{what} with schedule.kind disagg: its rollout ranks do not run tools yet; use "
                              "schedule.kind serial or overlap")
        if self.schedule.stream_groups:
            raise ConfigError(f"{what} with schedule.stream_groups: a finished group's passes in the decode window "
                              "would wait on the device for its observations' images; use schedule.stream_groups "
                              "false")
        if self.rollout.tp > self.parallel.tp:
            raise ConfigError(f"{what} with rollout.tp {self.rollout.tp} > parallel.tp {self.parallel.tp}: an "
                              "engine shared by several dp ranks would run each tool call on every one of them; "
                              "use rollout.tp <= parallel.tp")

    def _check_expert_parallel(self) -> None:
        """What parallel.ep > 1 cannot run with yet. The model's checks (it has MoE layers, ep divides their
        experts) come when it is split (rollplex.models.expert_parallel.check_ep), the world size's when the mesh
        is built (rollplex.dist.ParallelDims)."""
        ep = self.parallel.ep
        if ep == 1:
            return
        if self.schedule.kind == "disagg":
            raise ConfigError(f"parallel.ep {ep} with schedule.kind disagg: the disaggregated trainer's mesh has no "
                              "expert-parallel dimension yet; use serial or overlap, or parallel.ep 1")
        if self.lora.rank > 0:
            raise ConfigError(f"parallel.ep {ep} with lora.rank {self.lora.rank}: LoRA's frozen base stays whole "
                              "on every rank, outside FSDP, which expert parallelism does not split yet; use "
                              "parallel.ep 1")
