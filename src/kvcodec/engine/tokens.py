"""Text <-> token ids for the engine: prompts, chat templates, output text, end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcodec.errors import ConfigError

MAX_TOKEN_CHARS = 256  # bound assumed for a tokenizer without a vocabulary listing


class Tokens:
    """The engine's view of a (possibly absent) Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._max_chars: int | None = None
        self._control: tuple[str, ...] | None = None

    def max_token_chars(self) -> int:
        """Most characters one token stands for (the longest vocabulary entry; at least 1): a text
        of more than max_context times this many characters cannot fit the context."""
        if self._max_chars is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_chars = max([len(t) for t in vocab] or [MAX_TOKEN_CHARS])
        return max(1, self._max_chars)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this engine has no tokenizer: pass token ids")
            try:
                prompt.encode("utf-8")
                return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            except (UnicodeEncodeError, TypeError) as e:
                raise ConfigError(f"the prompt is not valid Unicode text: {e}") from None
        if isinstance(prompt, (bytes, bytearray)):  # its bytes would pass for token ids: a silently wrong answer
            raise ConfigError("a prompt is text or token ids, not bytes (decode it first)")
        try:
            items = list(prompt)
        except TypeError:
            raise ConfigError(f"a prompt is text or token ids; got {type(prompt).__name__}") from None
        return [t if isinstance(t, bool) else (int(t) if hasattr(t, "__index__") else t) for t in items]

    def control_tokens(self) -> tuple[str, ...]:
        """The text of the tokenizer's special tokens (its chat template's turn markers among them)."""
        if self._control is None:
            tok = self.tokenizer
            names = set(getattr(tok, "all_special_tokens", None) or ())
            names.update(str(t) for t in (getattr(tok, "added_tokens_decoder", None) or {}).values() if t.special)
            self._control = tuple(sorted(n for n in names if n))
        return self._control

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template. A message whose text
        holds a special token is refused: the rendered template is tokenized as a whole, so that
        text would become the real marker (a user's message could close its turn and open a system one)."""
        for i, m in enumerate(messages):
            found = next((t for t in self.control_tokens() if t in m["content"]), None)
            if found is not None:
                raise ConfigError(f"message {i} holds the model's control token {found!r}; message text cannot")
        tmpl = getattr(self.tokenizer, "chat_template", None)
        if tmpl:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:
                if not _template_refusal(e):
                    raise
                raise ConfigError(f"the model's chat template refuses these messages: {e}") from None
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def eos_ids(self, model: Any) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(model, "generation_config", None), getattr(model, "config", None), self.tokenizer):
            v = getattr(src, "eos_token_id", None)
            if v is None:
                continue
            ids.update(v if isinstance(v, (list, tuple, set)) else [v])
        return {int(i) for i in ids}


def _template_refusal(e: Exception) -> bool:
    """Whether a chat template's failure is its verdict on the messages (its raise_exception, a role or
    order it does not take: jinja2's errors, ValueError, TypeError), not a fault of the server."""
    return isinstance(e, (ValueError, TypeError)) or type(e).__module__.split(".")[0] == "jinja2"
