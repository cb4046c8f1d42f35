"""Write a tiny random checkpoint directory of a model family, offline.

    python tools/make_tiny_checkpoint.py --out /tmp/tiny
    python tools/make_tiny_checkpoint.py --out /tmp/tiny3 --family qwen3_vl
    python tools/make_tiny_checkpoint.py --out /tmp/tiny3_5 --family qwen3_5 --layers 4
    python tools/make_tiny_checkpoint.py --out /tmp/wide --hidden 512 --layers 8 --heads 8 --kv-heads 2 --vocab bytes

transformers loads the result with its own classes (AutoConfig, AutoTokenizer,
the family's ...ForConditionalGeneration); Rollplex loads it with
rollplex.models.from_pretrained and its processor with
rollplex.data.processor.load_processor.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollplex.models.registry import FAMILIES  # noqa: E402
from rollplex.tiny import TinySpec, make_tiny_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl", help="model family")
    # Shapes left out are the family's tiny model's (rollplex.tiny.TinySpec.of): e.g. Qwen3.5's 2 heads of 32.
    p.add_argument("--hidden", type=int, help="language model hidden size (default 64)")
    p.add_argument("--layers", type=int, help="language model layers (default 2)")
    p.add_argument("--heads", type=int, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default 2)")
    p.add_argument("--intermediate", type=int, help="MLP width (default: 2 x hidden)")
    p.add_argument("--vision-hidden", type=int, help="vision width (default 32; its MLP twice that)")
    p.add_argument("--vision-depth", type=int)
    p.add_argument("--vision-heads", type=int)
    p.add_argument("--vocab", choices=["words", "bytes"], default="words",
                   help="words: ~64-token word vocabulary (learnable from scratch); bytes: byte-level")
    p.add_argument("--vocab-size", type=int, default=None, help="embedding rows (default: tokenizer length padded)")
    p.add_argument("--mrope-section", type=int, nargs=3, default=None,
                   help="M-RoPE split of head_dim/2 (default: the family's, e.g. 2:3:3 for qwen2_5_vl)")
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embeddings")
    p.add_argument("--style", choices=["nested", "flat"], default="nested", help="config.json style")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    shape = {"hidden_size": a.hidden, "num_layers": a.layers, "num_heads": a.heads, "num_kv_heads": a.kv_heads,
             "intermediate_size": a.intermediate or (a.hidden and 2 * a.hidden), "vision_hidden_size": a.vision_hidden,
             "vision_depth": a.vision_depth, "vision_num_heads": a.vision_heads,
             "vision_intermediate_size": a.vision_hidden and 2 * a.vision_hidden,
             "mrope_section": tuple(a.mrope_section) if a.mrope_section else None}
    spec = TinySpec.of(a.family,
                       **{field: value for field, value in shape.items() if value is not None},
                       vocab=a.vocab, vocab_size=a.vocab_size, tie_word_embeddings=a.tie)
    out = make_tiny_checkpoint(a.out, spec, seed=a.seed, style=a.style)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
