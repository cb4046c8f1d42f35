"""A tool's or an environment's answer as the tokens a multi-turn episode continues with.

An episode's tokens stay exactly as the policy sampled them; only the observation is tokenised and prefilled onto
the sequence. Its tokens are what the chat template writes between the end of an assistant turn and the first
token of the next one, found by the template delta: a dummy conversation [user, assistant] is rendered, then the
same with the observation message(s) and the next turn's generation prompt, and the observation is everything the
second rendering adds after the assistant's content. So it starts with the template's assistant-turn close
("<|im_end|>\\n") and ends with the generation prompt ("<|im_start|>assistant\\n"), and the template decides how a
tool's answer looks (Qwen2.5-VL's "<|im_start|>tool\\n...", Qwen3's "<|im_start|>user\\n<tool_response>...").

A turn that ended at a tool call's closing tag has not closed the assistant turn yet: the turn close is the
observation's (`after_eos=False`). A turn that ended with the end-of-turn token the policy sampled itself
(`after_eos=True`) already holds it, so it is left off the observation's start.

`max_observation_tokens` cuts a longer observation, never silently and never through an image: in reading order,
an image that does not fit is left out whole and a short note stands in its place, and text is cut at a token with
a marker after it. The prompt's images and its image pads always match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollplex.data.processing import ImageInputs, prompt_from_rendered, render_chat
from rollplex.models.inputs import Prompt

if TYPE_CHECKING:
    from rollplex.agent.tools import ToolResult

# What the dummy conversation's assistant says: a string no template writes and no template rewrites (no
# whitespace or reasoning tags to strip), so its place in a rendering is unambiguous.
_ASSISTANT_CONTENT = "ROLLPLEX_ASSISTANT_TURN"
_DUMMY_USER = {"role": "user", "content": "U"}
_DUMMY_ASSISTANT = {"role": "assistant", "content": _ASSISTANT_CONTENT}
# What stands after text cut to fit, and in place of an image left out (on a line of its own: text may follow).
TRUNCATION_MARKER = "... (truncated)"
IMAGE_LEFT_OUT = "(image left out: too long)\n"


def _after_assistant(rendered: str, conversation: str) -> int:
    """Where the dummy assistant's content ends in `rendered`, the rendering of `conversation`."""
    at = rendered.find(_ASSISTANT_CONTENT)
    if at < 0:
        raise TemplateNotPrefixStable(f"the chat template's rendering of {conversation} does not hold the "
                                      f"assistant's content {_ASSISTANT_CONTENT!r}: {rendered!r}")
    return at + len(_ASSISTANT_CONTENT)


class TemplateNotPrefixStable(ValueError):
    """The chat template does not render an observation as a continuation of the assistant's turn."""


class ObservationOverLimit(ValueError):
    """Even cut to the bone (every image left out, every text down to the truncation marker) the observation is over
    max_observation_tokens: the template's framing alone does not fit."""


@dataclass
class RenderedObservation:
    """An observation's tokens and what was cut from it to fit."""

    prompt: Prompt  # its tokens (pads expanded) and its images' processor tensors, as prepare_prompt makes a prompt
    text: str  # what the model reads, pads not expanded
    truncated: bool = False  # something was cut to fit max_observation_tokens: text, images or both
    dropped_images: int = 0  # images left out whole (a note in each one's place)


@dataclass
class _Cut:
    """How much of each piece of the observation is shown: which images are kept, and how many tokens of each
    result's text (None: all of it)."""

    kept_images: set[int] = field(default_factory=set)  # indices into the observation's images, in reading order
    text_tokens: dict[int, int | None] = field(default_factory=dict)  # result index -> tokens shown


@dataclass
class _Piece:
    """One result's text and the indices of its images among the observation's."""

    text: str
    images: range


class ObservationRenderer:
    """Renders tool results or an environment's observation into the tokens an episode continues with
    (module docstring). `max_observation_tokens` = 0: no limit."""

    def __init__(self, processor: Any, max_observation_tokens: int = 0):
        if max_observation_tokens < 0:
            raise ValueError(f"max_observation_tokens must be >= 0 (0: no limit), got {max_observation_tokens}")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_tokens = max_observation_tokens
        closed = render_chat(processor, [_DUMMY_USER, _DUMMY_ASSISTANT], add_generation_prompt=False)
        # What the template writes after an assistant's content to close its turn ("<|im_end|>\n"), and to open the
        # next one (the generation prompt, "<|im_start|>assistant\n").
        self.turn_close = closed[_after_assistant(closed, "[user, assistant]"):]
        user_only = render_chat(processor, [_DUMMY_USER], add_generation_prompt=False)
        self.generation_prompt = render_chat(processor, [_DUMMY_USER])[len(user_only):]
        if not self.turn_close or not self.generation_prompt:
            raise TemplateNotPrefixStable(
                f"the chat template writes no assistant-turn close ({self.turn_close!r}) or no generation prompt "
                f"({self.generation_prompt!r}): an episode cannot continue after an observation")
        # The turn close's first token ("<|im_end|>"): the one a policy samples to end its turn itself.
        self.end_of_turn = self.tokenizer.decode(self._ids(self.turn_close)[:1])
        self._template_text([{"role": "tool", "content": [{"type": "text", "text": ""}]}])  # fails here, not mid-run

    def render(self, results: Sequence[ToolResult], role: str = "tool", after_eos: bool = False) -> RenderedObservation:
        """`results` (each with `.text` and `.images`, PIL images or arrays) as one observation: a message of `role`
        each ("tool" for tool results, "user" for an environment's observation), its images first, then its text.

        Raises MediaLoadError (a ValueError) for an image that cannot be read, TemplateNotPrefixStable when the
        template does not render the observation after the assistant's turn, ObservationOverLimit when not even the
        observation's framing fits max_observation_tokens.
        """
        if not results:
            raise ValueError("an observation needs at least one result")
        pieces, image_count = [], 0
        for result in results:
            pieces.append(_Piece(self._clean(result.text), range(image_count, image_count + len(result.images))))
            image_count += len(result.images)
        images = ImageInputs.of(self.processor, [image for result in results for image in result.images])
        image_tokens = [len(self._ids(pad_text)) for pad_text in images.pad_texts] if images else []

        def text_of(cut: _Cut) -> str:
            return self._text(self._messages(role, pieces, cut), after_eos)

        def fits(cut: _Cut) -> bool:
            # The rendered text holds one pad per kept image, each to become its image's pad text.
            tokens = len(self._ids(text_of(cut))) + sum(image_tokens[i] - 1 for i in cut.kept_images)
            return tokens <= self.max_tokens

        cut = _Cut(set(range(image_count)))
        if self.max_tokens and not fits(cut):
            cut = self._fit(pieces, fits)
        kept = sorted(cut.kept_images)
        text = text_of(cut)
        prompt = prompt_from_rendered(self.processor, text, images.select(kept) if images else None)
        dropped = image_count - len(kept)
        truncated = dropped > 0 or any(shown is not None for shown in cut.text_tokens.values())
        return RenderedObservation(prompt, text, truncated, dropped)

    def _fit(self, pieces: list[_Piece], fits: Callable[[_Cut], bool]) -> _Cut:
        """The cut that shows the most, in reading order, within the limit: each piece as much as fits with every
        piece after it at its least (images left out, texts down to the marker, unless shorter than it)."""
        marker = len(self._ids(TRUNCATION_MARKER))
        lengths = [len(self._ids(piece.text)) for piece in pieces]
        cut = _Cut(set(), {i: None if length <= marker else 0 for i, length in enumerate(lengths)})
        if not fits(cut):
            raise ObservationOverLimit(
                f"max_observation_tokens {self.max_tokens} does not hold even this observation's framing "
                f"({len(pieces)} message(s), their images left out and their texts cut to the marker): raise it")
        for i, piece in enumerate(pieces):
            for image in piece.images:
                cut.kept_images.add(image)
                if not fits(cut):
                    cut.kept_images.discard(image)
            cut.text_tokens[i] = self._most_text(cut, i, lengths[i], fits)
        return cut

    @staticmethod
    def _most_text(cut: _Cut, result: int, length: int, fits: Callable[[_Cut], bool]) -> int | None:
        """The most tokens of result `result`'s text that fit (None: all of it), by bisection; the cut fits with
        none of them (its marker alone) when this is called."""
        cut.text_tokens[result] = None
        if fits(cut):
            return None
        low, high = 0, length - 1  # with the marker, `low` tokens fit and `high + 1` do not
        while low < high:
            middle = (low + high + 1) // 2
            cut.text_tokens[result] = middle
            low, high = (middle, high) if fits(cut) else (low, middle - 1)
        cut.text_tokens[result] = low
        return low

    def _messages(self, role: str, pieces: list[_Piece], cut: _Cut) -> list[dict[str, Any]]:
        """One message per result: its images (or a note for each one left out), then its text as `cut` shows it."""
        messages = []
        for i, piece in enumerate(pieces):
            content: list[dict[str, Any]] = [
                {"type": "image"} if image in cut.kept_images else {"type": "text", "text": IMAGE_LEFT_OUT}
                for image in piece.images
            ]
            shown = self._shown_text(piece.text, cut.text_tokens.get(i))
            if shown or not content:
                content.append({"type": "text", "text": shown})
            messages.append({"role": role, "content": content})
        return messages

    def _shown_text(self, text: str, tokens: int | None) -> str:
        if tokens is None:
            return text
        return self.tokenizer.decode(self._ids(text)[:tokens]) + TRUNCATION_MARKER

    def _text(self, messages: list[dict[str, Any]], after_eos: bool) -> str:
        """The observation of `messages`: what their rendering after the assistant's turn adds to it."""
        text = self._template_text(messages)
        if after_eos:
            if not self.end_of_turn or not text.startswith(self.end_of_turn):
                raise TemplateNotPrefixStable(
                    f"after_eos: the observation should start with the end-of-turn token the policy sampled "
                    f"({self.end_of_turn!r}), but starts {text[:40]!r}")
            text = text[len(self.end_of_turn):]
        return text

    def _template_text(self, messages: list[dict[str, Any]]) -> str:
        rendered = render_chat(self.processor, [_DUMMY_USER, _DUMMY_ASSISTANT, *messages])
        text = rendered[_after_assistant(rendered, "[user, assistant, observation]"):]
        if not text.startswith(self.turn_close) or not text.endswith(self.generation_prompt):
            raise TemplateNotPrefixStable(
                f"the chat template does not render an observation as the continuation of the assistant's turn: "
                f"after the assistant's content it writes {text!r}, which should start with the turn close "
                f"{self.turn_close!r} and end with the generation prompt {self.generation_prompt!r}")
        return text

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _clean(self, text: str) -> str:
        # A tool's text holding the processor's own image / video pad token would make a pad without its image.
        for pad in (self.processor.image_token, self.processor.video_token):
            text = text.replace(pad, "")
        return text
