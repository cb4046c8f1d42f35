"""The tiny checkpoints' tokenizers and chat template (rollplex.tiny writes them
into a folder): the Qwen special tokens in Qwen's order, Qwen's chat template,
and two vocabularies.

  - ``"words"``: a ~70-token word-level vocabulary (Qwen special tokens, the chat
    template's words, colours / directions / shapes / digits for synthetic visual
    tasks, Qwen's tool-call tags and the `look` task's whole tool call). Small
    enough that a 2-layer model can actually learn a task.
  - ``"bytes"``: 256 byte tokens (GPT-2 byte-to-unicode alphabet, no merges) plus
    the specials and the reasoning tags; it encodes any text, for larger benchmark
    models. Tool-call tags are plain bytes there (they round-trip as text).
"""

from __future__ import annotations

import re

# --------------------------------------------------------------------------------------
# Special tokens, in Qwen's order (151643 ... 151656 in the real vocabulary).
# --------------------------------------------------------------------------------------
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    VISION_START,
    VISION_END,
    VISION_PAD,
    IMAGE_PAD,
    VIDEO_PAD,
)
UNK = "<unk>"
# Reasoning-format tags. They are ordinary (non-special) added tokens: decode keeps
# them with skip_special_tokens=True, so format rewards can see them.
TAG_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<answer>", "</answer>")

# Words of the default system prompt and the role names of the chat template.
TEMPLATE_WORDS: tuple[str, ...] = ("system", "user", "assistant", "you", "are", "a", "helpful")
PUNCTUATION: tuple[str, ...] = (".", "?")
QUESTION_WORDS: tuple[str, ...] = (
    "what", "which", "is", "the", "colour", "color", "shape", "direction",
    "does", "dot", "move", "answer", "how", "many",
)  # fmt: skip
COLOUR_WORDS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")
DIRECTION_WORDS: tuple[str, ...] = ("left", "right", "up", "down")
SHAPE_WORDS: tuple[str, ...] = ("circle", "square", "triangle")
DIGITS: tuple[str, ...] = tuple(str(i) for i in range(10))
ANSWER_WORDS: tuple[str, ...] = ("yes", "no")
# Qwen's Hermes-style tool-use tags (rollplex.agent), ordinary added tokens as in Qwen's vocabulary.
TOOL_TAGS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# "tool": the chat template's role name of a tool's answer; "look": the built-in look task's tool.
TOOL_WORDS: tuple[str, ...] = ("tool", "look")
# The look task's whole tool call (rollplex.agent.look), one token: a from-scratch tiny model cannot find a
# ~15-token JSON call by chance, as it could not spell a colour letter by letter. It decodes to exactly this
# text, which the tool-call parser reads like any other call.
LOOK_CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
# Tags that decoding glues to the word after (opening) or before (closing) them: "<answer>red</answer>".
_GLUED_TAGS = TAG_TOKENS + TOOL_TAGS

# Qwen2.5-VL's chat template (as shipped in the hub's chat_template.json), verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_vocabulary(extra_words: tuple[str, ...] = ()) -> list[str]:
    """Tokens of the word-level vocabulary, in id order (specials first)."""
    tokens = [
        *SPECIAL_TOKENS, UNK, *TAG_TOKENS, "\n", *TEMPLATE_WORDS, *PUNCTUATION, *QUESTION_WORDS,
        *COLOUR_WORDS, *DIRECTION_WORDS, *SHAPE_WORDS, *DIGITS, *ANSWER_WORDS,
        # After the words above, so that every id before them stays where it was.
        *TOOL_TAGS, *TOOL_WORDS, LOOK_CALL,
    ]  # fmt: skip
    for word in extra_words:
        # The normaliser lowercases input text, so plain words are stored lowercased;
        # multi-piece words ("<box>", "10") become case-sensitive added tokens.
        word = word.lower() if _is_single_piece(word) else word
        if word not in tokens:
            tokens.append(word)
    return tokens


# What the word pre-tokenizer keeps as one piece: a run of letters, one digit, or
# one other non-space character.
_WORD_PIECE = r"\n|[^\W\d_]+|\d|[^\w\s]|_"


def _is_single_piece(word: str) -> bool:
    return re.fullmatch(_WORD_PIECE, word.lower()) is not None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def words_tokenizer(extra_words: tuple[str, ...] = ()):
    """The word-level `tokenizers.Tokenizer` of `word_vocabulary(extra_words)`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel

    tokens = word_vocabulary(extra_words)
    tok = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK))
    # Lowercase so "You are a helpful assistant." (the default system prompt) and
    # capitalised questions stay in the small vocabulary.
    tok.normalizer = normalizers.Lowercase()
    # Keep "\n" as its own token (the chat template puts one after every role name
    # and <|im_end|>), split letters into words, digits one by one (as Qwen does) and
    # every other non-space character on its own; drop the other whitespace.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_WORD_PIECE), behavior="removed", invert=True)
    # Decoding: join words with spaces, then glue punctuation and newlines back.
    # (WordPiece with a prefix nothing uses == "join with spaces"; Fuse makes one
    # string so the Replace steps can see across token boundaries.)
    tok.decoder = decoders.Sequence(
        [
            decoders.WordPiece(prefix="##", cleanup=False),
            decoders.Fuse(),
            decoders.Replace(" \n", "\n"),
            decoders.Replace("\n ", "\n"),
            decoders.Replace(" .", "."),
            decoders.Replace(" ?", "?"),
            decoders.Replace(" ,", ","),
            decoders.Replace(" !", "!"),
            # "<answer>left</answer>" round-trips (format rewards parse the tags).
            *(decoders.Replace(f"{t} ", t) for t in _GLUED_TAGS if not t.startswith("</")),
            *(decoders.Replace(f" {t}", t) for t in _GLUED_TAGS if t.startswith("</")),
        ]
    )
    # Specials and tags are matched before normalisation/pre-tokenisation; they are
    # already in the vocabulary, so they keep their ids. Added tokens match leftmost-longest,
    # so the look call's text is its one token, not "<tool_call>" and pieces.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*TAG_TOKENS, *TOOL_TAGS, LOOK_CALL)])
    # Extra words the pre-tokenizer would split must be matched whole, before it.
    multi = [w for w in extra_words if not _is_single_piece(w)]
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in multi])
    return tok


def bytes_tokenizer():
    """The byte-level `tokenizers.Tokenizer`: every byte one token, then the specials and tags."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    # Byte-level BPE with no merges: every byte is one token (ids 0-255, in byte
    # order), any text round-trips; specials follow at 256+.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok
