"""What the two Qwen VL families, rollplex.models.qwen2_5_vl and
rollplex.models.qwen3_vl, share: one piece of code wherever their logic is the
same. Not a family itself (the registry lists none of it); each family package
builds on it, module by module:

- `args`: `QwenVLArgs`, the base of both `ModelArgs` (the token ids and
  tie_word_embeddings), the tiny models' token ids, and the decoder's parameter
  and matmul counts;
- `layers`: the building blocks: RMSNorm, SwiGLU, the patch embedding, the
  vision attention with split q/k/v and the pre-norm vision block, and the
  Qwen2 / Qwen3 decoder (`LanguageModel`, on the `Decoder` base Qwen3.5's
  hybrid decoder shares);
- `model`: `QwenVL`, the whole model's base class (every protocol call that
  reads the same in both), `VisionInputs` and `check_pixels`;
- `hf`: the checkpoint key mapping (the fused-qkv split, both key styles) and
  the config.json readers' common helpers;
- `tp_plan`: `check_tp`, the decoder layer's plan, the vision attention's and
  SwiGLU's plans, the FSDP units and the vision tower.

What differs stays in each family's package: its VisionArgs and TextArgs (and
their defaults), `rope_spec` and named sizes (`args`); its vision tower, patch
merger and vision plan, and what it adds to the shared model (Qwen3-VL: the
learned position grid and DeepStack) (`model`); its config.json style and which
key style it writes (`hf`); which parts of its tower split and when (`tp_plan`);
its processor and tiny checkpoint.
"""
