"""Text in and out of a target: prompts through its chat template, its end-of-sequence ids, stop
strings, and detokenisation that costs O(new tokens) per round.

Decoding the whole output again every round costs O(n) a round, O(n²) a request. Decoding each new
token alone is wrong: a byte-level BPE splits one UTF-8 character over several tokens, and a
SentencePiece decoder drops the leading space of whatever it decodes first. `IncrementalDetokenizer`
therefore decodes a window: a few tokens that are text already (their context) plus the new ones, and
keeps what the new ones add (the prefix and read offsets of vLLM and TGI).
"""

from collections.abc import Sequence

import torch

from dspark.errors import DsparkError
from dspark.loading import LoadedTarget

Messages = list[dict[str, str]]

#: tokens already turned into text that each window starts with, so the new tokens decode in context
CONTEXT_TOKENS = 3
#: what a decoder writes for bytes that are not (yet) a whole UTF-8 character
REPLACEMENT = "\ufffd"


def validate_prompt(prompt: str | Messages) -> None:
    if isinstance(prompt, str) and not prompt.strip():
        raise DsparkError("prompt is empty")
    if isinstance(prompt, list) and not prompt:
        raise DsparkError("messages are empty")


def prompt_ids(loaded: LoadedTarget, prompt: str | Messages, chat: bool = True) -> torch.Tensor:
    """Token ids of the prompt, through the target's chat template unless `chat` is False."""
    validate_prompt(prompt)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise DsparkError(f"target {loaded.name} has no tokenizer; pass token ids instead")
    if chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        ids = encoded["input_ids"]
    else:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        ids = tokenizer(text)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def eos_token_ids(loaded: LoadedTarget) -> frozenset[int]:
    """Every id that ends generation: the generation config's, the model config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, list | tuple | set) else [eos])
    return frozenset(int(i) for i in ids)


def stop_cut(text: str, stop: Sequence[str]) -> int | None:
    """Where the first stop string found in `text` begins, or None."""
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


class IncrementalDetokenizer:
    """Token ids in, text out; all of it joined equals decoding every token at once.

    Each `add` decodes tokens[prefix_offset:read_offset] (context, text already) and
    tokens[prefix_offset:] and returns the difference. While that ends in "\ufffd" the bytes may be a
    character still incomplete: nothing is returned, the text waits (`pending`) and the offsets stay,
    so the next tokens are decoded together with those bytes. A window is the context (a few tokens)
    plus the tokens since the text last ended on a whole character: O(new tokens) per call."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0  # the window starts here
        self.read_offset = 0  # tokens before this are text already
        self.boundaries = [0]  # recent offsets where the text ended on a whole character: windows start there
        self.pending = ""  # the text after the read offset while it ends in "\ufffd"

    def add(self, tokens: Sequence[int]) -> str:
        """The text after the read offset once it ends on a whole character, else ""."""
        self.tokens.extend(tokens)
        self.pending = self._text_after_read_offset()
        if self.pending.endswith(REPLACEMENT):
            return ""
        return self.flush()

    def flush(self) -> str:
        """The text after the read offset as it is: what `add` returns on a whole character, and what is
        left once no token follows."""
        text, self.pending = self.pending, ""
        self._advance()
        return text

    def mark(self) -> tuple[int, int, list[int]]:
        """Where the text last ended on a whole character, to `rewind` to."""
        return self.prefix_offset, self.read_offset, list(self.boundaries)

    def rewind(self, mark: tuple[int, int, list[int]]) -> list[int]:
        """Back to `mark`; the tokens added since, to add again."""
        self.prefix_offset, self.read_offset, boundaries = mark
        self.boundaries = list(boundaries)
        again = self.tokens[self.read_offset :]
        del self.tokens[self.read_offset :]
        self.pending = ""
        return again

    def _advance(self) -> None:
        """Move the read offset to the end and start the window at the last boundary at least
        CONTEXT_TOKENS before it: a window starting mid-character decodes it (and, with byte fallback,
        the whole byte run after it) as "\ufffd"."""
        self.read_offset = len(self.tokens)
        self.boundaries.append(self.read_offset)
        while len(self.boundaries) > 1 and self.boundaries[1] <= self.read_offset - CONTEXT_TOKENS:
            self.boundaries.pop(0)
        self.prefix_offset = self.boundaries[0]

    def _text_after_read_offset(self) -> str:
        context = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        return self._decode(self.tokens[self.prefix_offset :])[len(context) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class TextAccumulator:
    """Token ids in, text deltas out, for `stream` and the server. Holds back the tail that could
    still grow into a stop string (and any incomplete UTF-8 character) and cuts at the first stop
    string, keeping the tokens through it (as HF does). Each `add` costs O(its tokens)."""

    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop or [] if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stopped = False
        self._sent: list[str] = []
        self._held = ""  # final text not sent yet; ends with the last `holdback` characters of all of it

    @property
    def tokens(self) -> list[int]:
        """Every token added; after a stop string, those through the token that completed it."""
        return self.detokenizer.tokens

    @property
    def text(self) -> str:
        """The text so far (joined once, when asked); after a stop string, everything before it."""
        pending = "" if self.stopped else self.detokenizer.pending
        return "".join(self._sent) + self._held + pending

    def add(self, tokens: list[int]) -> str:
        """The text that is now final; after a stop string, everything before it."""
        if self.stopped:
            return ""
        if not self.stop:
            self._held += self.detokenizer.add(tokens)
            return self._release()
        mark, held = self.detokenizer.mark(), self._held
        if self._append(tokens) is None:
            return self._release()
        self._held = held  # a stop string: again one token at a time, from the last whole character
        for token in self.detokenizer.rewind(mark):
            cut = self._append([token])
            if cut is not None:
                self._held, self.stopped = self._held[:cut], True
                return self.flush()
        return self._release()

    def _append(self, tokens: list[int]) -> int | None:
        """Add the tokens' text; where in the held text the first stop string now begins, or None."""
        start = max(0, len(self._held) - self.holdback)  # a stop string beginning earlier was found already
        self._held += self.detokenizer.add(tokens)
        cut = stop_cut(self._held[start:], self.stop)
        return None if cut is None else start + cut

    def flush(self) -> str:
        """Whatever was held back (call once generation has ended)."""
        if not self.stopped:
            self._held += self.detokenizer.flush()
        delta, self._held = self._held, ""
        self._sent.append(delta)
        return delta

    def _release(self) -> str:
        ready = len(self._held) - self.holdback
        if ready <= 0:
            return ""
        delta, self._held = self._held[:ready], self._held[ready:]
        self._sent.append(delta)
        return delta
