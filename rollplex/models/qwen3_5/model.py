"""Qwen3.5 (dense) in plain PyTorch: Qwen3-VL's vision tower without DeepStack, the
hybrid Gated DeltaNet / gated attention decoder (rollplex.models.qwen3_5.decoder),
interleaved M-RoPE over part of each head.

The whole model is rollplex.models.qwen_vl's `QwenVL` (vision features written
at their pad tokens, logits, the transformers-style forward); what differs here:
- the tower is rollplex.models.qwen3_vl's `VisionTransformer` with no DeepStack
  blocks, so the decoder adds nothing after its layers;
- the packed forward passes the decoder a `PackedHybridAttention`, which gives
  the DeltaNet layers each sequence's boundaries as well as attention, or, for GRPO
  groups sharing their prompt, a `SharedPrefixHybridAttention`, which starts each
  response's convolution and recurrence from its prompt's final states.

The engine's decode and prefill, and the kept-prefix passes, pass their own
backends with the same calls (rollplex.engine.recurrent_state, rollplex.train.kept_prefix).
"""

from __future__ import annotations

from typing import Any

import torch

from rollplex.dist import local_tensor
from rollplex.models.inputs import VisionEmbeds
from rollplex.models.moe import Routing, with_routing
from rollplex.models.packing import PackedBatch
from rollplex.models.protocol import RecurrentStateShapes
from rollplex.models.qwen3_5.args import FULL_ATTENTION, LINEAR_ATTENTION, HybridArgs
from rollplex.models.qwen3_5.decoder import HybridDecoder
from rollplex.models.qwen3_5.mixing import PackedHybridAttention, SharedPrefixHybridAttention
from rollplex.models.qwen3_vl.model import VisionTransformer, check_acts
from rollplex.models.qwen_vl.layers import MlpFactory, dense_mlp
from rollplex.models.qwen_vl.model import QwenVL


class Qwen3_5(QwenVL):
    """Qwen3.5 (dense) for causal LM (see the module docstring); `mlp` makes each decoder layer's
    MLP (rollplex.models.qwen3_5_moe's model gives its sparse MoE block)."""

    def __init__(self, args: HybridArgs, mlp: MlpFactory = dense_mlp):
        check_acts(args)
        if args.vision.deepstack_visual_indexes:
            raise ValueError("Qwen3.5's vision tower has no DeepStack blocks, got deepstack_visual_indexes "
                             f"{args.vision.deepstack_visual_indexes}")
        super().__init__(args, VisionTransformer(args.vision), HybridDecoder(args.text, mlp))

    def vision_embeds(self, image: Any, video: Any) -> VisionEmbeds:
        """The tower gives (merged features, None) per kind: no DeepStack levels."""
        return VisionEmbeds(*(None if out is None else out[0] for out in (image, video)))

    def kv_heads_per_rank(self) -> int:
        """The KV heads of this rank's full-attention layers, read off k_proj's rows."""
        weight = self.language_model.first_attention_layer().k_proj.weight
        return local_tensor(weight).shape[0] // self.args.text.head_dim

    def kv_layers(self) -> list[int]:
        """The full-attention layers: only they keep K/V."""
        return [i for i, layer in enumerate(self.language_model.layers) if layer.kind == FULL_ATTENTION]

    def recurrent_state_shapes(self) -> RecurrentStateShapes | None:
        """Each Gated DeltaNet layer's convolution tail and recurrent state (every layer's shapes are the
        same); None for a layer pattern without one."""
        deltanets = [(i, layer.linear_attn) for i, layer in enumerate(self.language_model.layers)
                     if layer.kind == LINEAR_ATTENTION]
        if not deltanets:
            return None
        conv, recurrent = deltanets[0][1].state_shapes()
        return RecurrentStateShapes(tuple(i for i, _ in deltanets), conv, recurrent)

    def forward_packed(self, batch: PackedBatch, vision: VisionEmbeds | None = None,
                       routing: Routing | None = None) -> torch.Tensor:
        """Hidden states of a packed batch: whole sequences, each from a zero recurrent state, or
        GRPO groups sharing their prompt (`batch.groups`), each response's recurrence starting from
        its prompt's final state; encodes its images/videos unless `vision` is given. An MoE
        decoder's layers route through `routing` (rollplex.models.moe) when given."""
        if vision is None:
            vision = self.encode_vision(batch.pixel_values, batch.image_grid_thw, batch.pixel_values_videos,
                                        batch.video_grid_thw)
        device = batch.input_ids.device
        if batch.groups is not None:
            mixing = SharedPrefixHybridAttention(batch.groups, device, backend=self.attn_backend)
        else:
            mixing = PackedHybridAttention(batch.cu_seqlens.tolist(), device, backend=self.attn_backend)
        return self(batch.input_ids, batch.position_ids, with_routing(mixing, routing), vision, batch.prompt_mask)
