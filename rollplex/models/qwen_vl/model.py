"""The whole model both Qwen VL families build (rollplex.models.qwen_vl): `QwenVL`,
a vision tower (`visual`), the decoder (`language_model`, a
rollplex.models.qwen_vl.layers.Decoder) and an LM head unless the
embeddings are tied, with every call of the `VisionLanguageModel` protocol that
reads the same in both families: embedding with the vision features at their
pad tokens, the prompt, layer-by-layer and decode forwards, logits, the packed
and the transformers-style forwards.

A family's subclass builds its own tower and passes it in with its decoder, and
overrides what differs: `vision_embeds` when its tower gives more than the
merged features of each kind, `layer_additions` when its decoder adds vision
features to the hidden states after its layers (Qwen3-VL's DeepStack). A tower
has `attn_backend`, `plan(grid_thw, device)`, which reads the grids on the host
and builds every device tensor the tower reads, and `forward(pixels, plan)`.

No parallelism and no scheduling in here: attention goes through the
`AttentionBackend` the caller passes in (rollplex.ops.attention), tensor and data
parallelism are applied from outside (each family's `tp_plan`, applied by
rollplex.train.parallelize).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.dist import local_tensor
from rollplex.models.inputs import VisionEmbeds, VisionSlots
from rollplex.models.moe import Routing, with_routing
from rollplex.models.packing import PackedBatch, pack_padded
from rollplex.models.protocol import Positions, RecurrentStateShapes, fsdp_entry
from rollplex.models.qwen_vl.args import QwenVLArgs
from rollplex.models.qwen_vl.layers import AfterLayer, Decoder
from rollplex.ops.attention import AttentionBackend, SharedPrefixAttention, VarlenAttention, resolve_backend


class VisionInputs:
    """What the vision tower reads for a batch's images and videos, on the model's
    device: each kind's pixels and the plan the tower made of its grids, or None
    (`QwenVL.prepare_vision` makes it). A plain class, not a dataclass: FSDP2 would
    rebuild it, casting its pixels and tables, at the model's entry."""

    def __init__(self, image: tuple[torch.Tensor, Any] | None = None, video: tuple[torch.Tensor, Any] | None = None):
        self.image, self.video = image, video


class QwenVL(nn.Module):
    """A Qwen VL model for causal LM (see the module docstring for what a family supplies).

    Main forward: packed tokens (no padding) -> final hidden states. Logits are a
    separate step (`logits`), so that callers who need only a few positions
    (decode) or per-token logprobs in chunks (training) never build the full
    (tokens, vocab) tensor at once.
    """

    def __init__(self, args: QwenVLArgs, visual: nn.Module, language_model: Decoder):
        super().__init__()
        self.args = args
        self.visual = visual
        self.language_model = language_model
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.text.hidden_size, args.text.vocab_size,
                                                                       bias=False)
        self.attn_backend = "torch"

    def set_attn_backend(self, name: str) -> None:
        """auto / torch / flash / flex / varlen, resolved for the model's device (ops.attention.resolve_backend)."""
        self.attn_backend = self.visual.attn_backend = resolve_backend(name, self.device)

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def text_rotary_table(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """cos | sin (num_positions, 2 * head_dim) of text positions 0, 1, ...: decode steps read its rows."""
        return self.language_model.rotary.text_table(num_positions, device, dtype)

    def decoder_stages(self) -> dict[str, nn.Module]:
        """The text decoder's modules in order, by name ("embedding", "decoder layer i", "final norm")."""
        lm = self.language_model
        return {"embedding": lm.embed_tokens, **{f"decoder layer {i}": layer for i, layer in enumerate(lm.layers)},
                "final norm": lm.norm}

    # ------------------------------------------------------------------------- vision

    def encode_vision(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                      pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> VisionEmbeds:
        """Run the vision tower on a prompt's (or batch's) images and videos, wherever
        they are (they are moved to the model's device)."""
        return self.encode_prepared(self.prepare_vision(pixel_values, image_grid_thw, pixel_values_videos,
                                                        video_grid_thw))

    def prepare_vision(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                       pixel_values_videos: torch.Tensor | None = None,
                       video_grid_thw: torch.Tensor | None = None) -> VisionInputs:
        """The first half of `encode_vision`: checks the inputs and builds every device
        tensor the tower reads (host reads of the grids, the tower's tables and
        attention segments, and the host-to-device copies), so that `encode_prepared`
        issues none."""
        inputs = VisionInputs()
        if pixel_values is not None:
            check_pixels(pixel_values, image_grid_thw, self.args.vision, "image")
            inputs.image = (pixel_values.to(self.device), self.visual.plan(image_grid_thw, self.device))
        if pixel_values_videos is not None:
            check_pixels(pixel_values_videos, video_grid_thw, self.args.vision, "video")
            inputs.video = (pixel_values_videos.to(self.device), self.visual.plan(video_grid_thw, self.device))
        return inputs

    @fsdp_entry
    def encode_prepared(self, inputs: VisionInputs) -> VisionEmbeds:
        """The vision tower on inputs from `prepare_vision`."""
        return self.vision_embeds(*(None if kind is None else self.visual(*kind) for kind in (inputs.image,
                                                                                               inputs.video)))

    def vision_embeds(self, image: Any, video: Any) -> VisionEmbeds:
        """The tower's outputs for the images and for the videos (None for a kind not
        given) as `VisionEmbeds`. Here each is the merged features (rows, hidden)."""
        return VisionEmbeds(image, video)

    # ------------------------------------------------------------------------- text

    def embed(self, input_ids: torch.Tensor, vision: VisionEmbeds | None = None,
              prompt_mask: torch.Tensor | None = None, slots: VisionSlots | None = None) -> torch.Tensor:
        """Token embeddings with vision features written at their pad tokens.

        Only prompt tokens carry vision features: a pad token id that a policy
        *generated* is embedded as plain text. `prompt_mask` (T,) marks the prompt
        tokens; None means every token is part of a prompt. The slots are found
        here (reading the ids on the host) unless given (`VisionSlots.find`).
        """
        h = self.language_model.embed_tokens(input_ids)
        if slots is None:
            slots = VisionSlots.find(self.args, input_ids, prompt_mask)
        for name, rows, feats in (("image", slots.image, vision.image if vision else None),
                                  ("video", slots.video, vision.video if vision else None)):
            n_tokens = rows.shape[0]
            n_feats = 0 if feats is None else feats.shape[0]
            if n_tokens != n_feats:
                raise ValueError(
                    f"{name} features and {name} pad tokens disagree: {n_tokens} <|{name}_pad|> tokens in the input "
                    f"but {n_feats} {name} feature rows (from the {name} grids). A prompt truncated through an "
                    f"{name}, or a grid that does not belong to this prompt, causes this."
                )
            if n_feats:
                h = h.index_copy(0, rows, feats.to(h.dtype))
        return h

    @fsdp_entry
    def embed_prompts(self, input_ids: torch.Tensor, vision: VisionEmbeds | None,
                      slots: VisionSlots) -> torch.Tensor:
        """`embed` as an entry of its own (FSDP2 gathers the root's parameters there, see
        `fsdp_entry`): a prompt forward (rollplex.train.kept_prefix) may start here, with
        cached vision features, then run `layer_by_layer` with the same vision and slots
        (its last slice reads the root's final norm)."""
        return self.embed(input_ids, vision, slots=slots)

    def layer_additions(self, vision: VisionEmbeds | None, slots: VisionSlots | None) -> AfterLayer | None:
        """What the decoder adds to its hidden states after its layers, from a prompt's
        `vision` at its `slots` (`LanguageModel.layer_by_layer`'s `after_layer`): here
        nothing, the vision features go in at the embedding only. Called before the
        decoder runs, so that what it checks raises there."""
        return None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttentionBackend,
                vision: VisionEmbeds | None = None, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (T,) packed, position_ids (3, T) -> final hidden states (T, hidden)."""
        slots = VisionSlots.find(self.args, input_ids, prompt_mask)
        return self.language_model(self.embed(input_ids, vision, slots=slots), position_ids, attn,
                                   self.layer_additions(vision, slots))

    def layer_by_layer(self, h: torch.Tensor, position_ids: Positions, attn: AttentionBackend,
                       vision: VisionEmbeds | None = None,
                       slots: VisionSlots | None = None) -> Iterator[torch.Tensor]:
        """`LanguageModel.layer_by_layer` of embedded tokens `h` (see `embed_prompts`), with
        the `layer_additions` of `vision` at `slots`."""
        return self.language_model.layer_by_layer(h, position_ids, attn, self.layer_additions(vision, slots))

    def kv_heads_per_rank(self) -> int:
        """The KV heads of this rank's attention layers, read off k_proj's rows: under
        tensor parallelism it holds this rank's heads only."""
        weight = self.language_model.layers[0].self_attn.k_proj.weight
        return local_tensor(weight).shape[0] // self.args.text.head_dim

    def kv_layers(self) -> list[int]:
        """Every decoder layer keeps K/V."""
        return list(range(self.args.text.num_hidden_layers))

    def recurrent_state_shapes(self) -> RecurrentStateShapes | None:
        """No layer carries a recurrent state."""
        return None

    @fsdp_entry
    def forward_generated(self, input_ids: torch.Tensor, position_ids: Positions,
                          attn: AttentionBackend) -> torch.Tensor:
        """Forward of generated tokens only (decode): plain embeddings, no vision
        features (none added inside the decoder either) and no host synchronisation,
        so it can run in a CUDA graph. position_ids as `LanguageModel.layer_by_layer`
        takes them."""
        return self.language_model(self.language_model.embed_tokens(input_ids), position_ids, attn)

    @fsdp_entry
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.language_model.embed_tokens.weight)
        return self.lm_head(hidden)  # through the module, so a parallel plan's hooks apply

    def forward_packed(self, batch: PackedBatch, vision: VisionEmbeds | None = None,
                       routing: Routing | None = None) -> torch.Tensor:
        """Hidden states of a packed batch; encodes its images/videos unless `vision` is given. An MoE
        decoder's layers route through `routing` (rollplex.models.moe) when given."""
        if vision is None:
            vision = self.encode_vision(batch.pixel_values, batch.image_grid_thw, batch.pixel_values_videos,
                                        batch.video_grid_thw)
        if batch.groups is not None:
            attn = SharedPrefixAttention(batch.groups, self.attn_backend)
        else:
            # Boundaries on the host (the packed batch keeps them there): no layer waits on the device.
            attn = VarlenAttention(batch.cu_seqlens.tolist(), batch.input_ids.device, backend=self.attn_backend)
        return self(batch.input_ids, batch.position_ids, with_routing(attn, routing), vision, batch.prompt_mask)

    @torch.no_grad()
    def hf_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                   pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                   second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, vocab) for exactly what the transformers processor returns
        for a left- or right-padded batch. Pad positions get zero logits.
        `second_per_grid_ts` goes to the M-RoPE positions, as the family's `rope_spec`
        reads them (Qwen3-VL's leaves it unread: its video positions count frame groups,
        with their timestamps written as text)."""
        batch = pack_padded(self.args, input_ids, attention_mask, pixel_values, image_grid_thw,
                            pixel_values_videos, video_grid_thw, second_per_grid_ts)
        logits = self.logits(self.forward_packed(batch))
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        out[mask] = logits
        return out


def check_pixels(pixels: torch.Tensor, grid_thw: torch.Tensor | None, args: Any, kind: str) -> None:
    """A kind's pixels (patches, C*T*P*P) against its grids (n, 3) and the family's VisionArgs `args`."""
    if grid_thw is None:
        raise ValueError(f"{kind} pixels were given without their {kind}_grid_thw")
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"{kind}_grid_thw must have shape (n, 3), got {tuple(grid_thw.shape)}")
    patches = int(grid_thw.prod(-1).sum())
    row = args.in_channels * args.temporal_patch_size * args.patch_size**2
    if pixels.ndim != 2 or pixels.shape[0] != patches or pixels.shape[1] != row:
        raise ValueError(
            f"{kind} pixel tensor of shape {tuple(pixels.shape)} does not match its grids "
            f"{grid_thw.tolist()}: expected ({patches}, {row})"
        )
    m = args.spatial_merge_size
    if bool(((grid_thw[:, 1:] % m) != 0).any()):
        raise ValueError(f"{kind} grid {grid_thw.tolist()} has a height or width not divisible by the merge size {m}")
