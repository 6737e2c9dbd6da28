"""Checks a request must pass before it is queued (a bad request never reaches an engine step,
where it would fail beside other requests). Each raises ConfigError with the field's name."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvcodec.engine.sequence import SamplingParams
from kvcodec.errors import ConfigError


def sampling_params(**options: object) -> SamplingParams:
    """SamplingParams from keyword options; an option it has not is a ConfigError naming it."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(options) - fields)
    if unknown:
        hint = " (stop strings are the server's: Python stops on stop_token_ids)" if "stop" in unknown else ""
        raise ConfigError(f"no sampling option {', '.join(unknown)}; there are {', '.join(sorted(fields))}{hint}")
    return SamplingParams(**options)


def check_sampling(p: SamplingParams) -> None:
    if not isinstance(p.max_new_tokens, int) or isinstance(p.max_new_tokens, bool) or p.max_new_tokens < 1:
        raise ConfigError(f"max_tokens must be an integer >= 1; got {p.max_new_tokens!r}")
    if not _finite(p.temperature) or p.temperature < 0:
        raise ConfigError(f"temperature must be a finite number >= 0; got {p.temperature!r}")
    if not _finite(p.top_p) or not 0 < p.top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1]; got {p.top_p!r}")
    if p.seed is not None and (not isinstance(p.seed, int) or isinstance(p.seed, bool) or not 0 <= p.seed < 2**63):
        raise ConfigError(f"seed must be an integer in [0, 2**63); got {p.seed!r}")
    stops = p.stop_token_ids
    if not isinstance(stops, (list, tuple, set, frozenset)) or not all(_is_int(t) and t >= 0 for t in stops):
        raise ConfigError(f"stop_token_ids must be a list of token ids; got {stops!r}")
    if not isinstance(p.ignore_eos, bool):
        raise ConfigError(f"ignore_eos must be True or False; got {p.ignore_eos!r}")


def check_token_ids(ids: Sequence[int], vocab_size: int | None, what: str = "prompt") -> None:
    """Every id an int in [0, vocab_size)."""
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size):
        return  # the common case in C-level passes (a 2k-token prompt: 0.1 ms, not 1.7); else find the culprit
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ConfigError(f"{what} token {i} is not an integer: {t!r}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ConfigError(f"{what} token {i} = {t} is outside the vocabulary [0, {vocab_size})")


def check_context(prompt_len: int, max_new_tokens: int, max_context: int | None) -> None:
    """The prompt and its longest answer fit the model's context."""
    if prompt_len < 1:
        raise ConfigError("empty prompt")
    if max_context is None:
        return
    if prompt_len >= max_context:
        raise ConfigError(f"prompt of {prompt_len} tokens does not fit the model's context of {max_context} tokens")
    if prompt_len + max_new_tokens > max_context:
        raise ConfigError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{max_context} tokens; ask for at most {max_context - prompt_len}"
        )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
