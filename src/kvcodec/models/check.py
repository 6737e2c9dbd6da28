"""What a model's KV cache will hold, read from its config alone, in seconds, before any weights load.

    layout = inspect_model("smollm2-135m")        # a registered name, a model directory or a .gguf file
    layout.spec                                   # KVSpec: kind and shapes per layer (sliding: its window)
    layout.ropes[i]                               # layer i's keys' rotary settings (None: none to remove)

Every command that takes `--model` (extract, calibrate, serve, the integrations) calls this first, so
a model kvcodec cannot code (recurrent or linear-attention layers, a RoPE scaling it does not know,
a config without head counts) fails with one line instead of after minutes of loading and prefill.
Layer kinds come from transformers' own `DynamicCache(config=...)` (the cache the model will fill),
shapes from the config (MLA: the compressed latent and the decoupled RoPE key), RoPE per layer type
from `rope_parameters` / `layer_types` (transformers 5), with `no_rope_layers` honoured.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvcodec.errors import ConfigError, ShapeError
from kvcodec.kvspec.spec import GroupSpec, KVSpec, LayerSpec
from kvcodec.transform.rope import IMPLICIT_ROPE_MODEL_TYPES, RopeSpec

_LAYER_KINDS = {"DynamicLayer": "full", "DynamicSlidingWindowLayer": "sliding"}
# decoder-only families whose keys carry no rotation (learned or fixed absolute positions, ALiBi): their
# KV is coded as it is, with no RoPE to remove
UNROTATED_MODEL_TYPES = ("gpt2", "gpt_bigcode", "gpt_neo", "opt", "bloom", "mpt", "xglm", "biogpt")


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """A model's cache as its config describes it: the KVSpec, and each layer's RoPE on the keys."""

    name: str
    model_type: str
    spec: KVSpec
    ropes: tuple[RopeSpec | None, ...]

    def group_rope(self, group: GroupSpec) -> RopeSpec | None:
        """The rotary settings of a group's keys (one for all its layers); None for MLA streams and
        layers without RoPE. A group whose layers rotate differently is refused."""
        if group.kind == "mla" or group.stream != "kv":
            return None
        ropes = {self.ropes[i] for i in group.layers}
        if len(ropes) != 1:
            raise ConfigError(
                f"model {self.name}: layers {group.layers} of group {group.name} use different RoPE settings; "
                "kvcodec's transform needs one per layer group"
            )
        return ropes.pop()

    @property
    def uniform_rope(self) -> RopeSpec | None:
        """The one RoPE of a uniform cache (ConfigError when layers differ)."""
        return self.group_rope(self.spec.groups[0])


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def model_config(name: str) -> Any:
    """The transformers config of a registered model, a model directory or a .gguf file, without weights."""
    from transformers import AutoConfig

    from kvcodec.models.local import is_local
    from kvcodec.models.registry import MODELS, gguf_path, model_cache_path

    if name in MODELS:
        folder = model_cache_path(name)
        if (folder / "config.json").is_file():
            where, extra = folder, {}
        else:
            path = gguf_path(name)
            where, extra = path.parent, {"gguf_file": path.name}
    elif is_local(name):
        path = Path(name).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"model directory {name!r} has no config.json (a transformers model folder is needed)"
                )
            where, extra = path, {}
        elif path.is_file() and path.suffix == ".gguf":
            where, extra = path.parent, {"gguf_file": path.name}
        else:
            raise ConfigError(f"model {name!r} is neither a registered name, a model directory nor a .gguf file")
    else:
        from kvcodec.models.registry import list_models

        raise ConfigError(
            f"unknown model {name!r}: give a registered name ({', '.join(list_models())}), "
            "a transformers model directory or a .gguf file"
        )
    if extra:  # a GGUF file: its header alone (transformers' parser reads every vocabulary string)
        from kvcodec.models.gguf_config import DamagedGGUFError, gguf_config

        try:
            return gguf_config(Path(where) / extra["gguf_file"])
        except ConfigError as e:
            if isinstance(e, DamagedGGUFError) or "is not one transformers loads" in str(e):
                raise ConfigError(f"model {name!r}: {e}") from e
    try:
        return AutoConfig.from_pretrained(str(where), **extra)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ConfigError(f"cannot read the config of model {name!r}: {str(e).splitlines()[0]}") from e


def _int(c: Any, attr: str, name: str, default: Any = None) -> int:
    value = getattr(c, attr, None) or default
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model {name}: its config gives no valid {attr} ({value!r})")
    return value


def _cache_kinds(config: Any, name: str) -> list[tuple[str, int | None]]:
    """(kind, keep) per layer of the DynamicCache the model will fill."""
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=config).layers
    except Exception as e:  # transformers raises many types for configs it cannot lay out
        raise ConfigError(f"model {name}: transformers cannot lay out its cache ({str(e).splitlines()[0]})") from e
    out = []
    for i, layer in enumerate(layers):
        kind = _LAYER_KINDS.get(type(layer).__name__)
        if kind is None:
            raise ShapeError(
                f"model {name}: cache layer {i} is a {type(layer).__name__} (not keys and values kvcodec can code); "
                "serve it with --no-reuse --no-store"
            )
        keep = int(layer.sliding_window) - 1 if kind == "sliding" else None
        out.append((kind, keep))
    return out


def _unrotated(c: Any) -> bool:
    """Whether a (text) config's model rotates no keys: a family without RoPE, or ALiBi in place of it."""
    return str(getattr(c, "model_type", "")) in UNROTATED_MODEL_TYPES or getattr(c, "alibi", False) is True


def _layer_rope(c: Any, i: int, name: str) -> RopeSpec | None:
    if _unrotated(c):
        return None
    no_rope = getattr(c, "no_rope_layers", None)
    if no_rope is not None and i < len(no_rope) and not no_rope[i]:
        return None
    types = list(getattr(c, "layer_types", None) or [])
    try:
        return RopeSpec.from_hf_config(c, types[i] if i < len(types) else None)
    except ConfigError as e:
        raise ConfigError(f"model {name}, layer {i}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"model {name}, layer {i}: unreadable RoPE settings ({e})") from e


def _refuse_architecture(config: Any, c: Any, name: str) -> None:
    """Say first when the model is not a decoder-only language model with rotary positions (every
    layout and transform kvcodec has assumes one), rather than naming a missing setting."""
    kind = str(getattr(config, "model_type", "") or "this")
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"model {name}: {kind} is an encoder-decoder model; kvcodec reuses the prefix KV cache of "
            "decoder-only language models"
        )
    if _recurrent(c):
        if getattr(c, "num_attention_heads", None) is None:
            raise ConfigError(
                f"model {name}: {kind} keeps a recurrent state and no attention KV cache; kvcodec reuses the prefix "
                "KV cache of attention models"
            )
        raise ShapeError(
            f"model {name}: {kind} keeps a recurrent state (state-space or linear-attention layers) beside its "
            "attention, which a KV cache does not hold; serve it with --no-reuse --no-store"
        )
    if _unrotated(c) or str(getattr(c, "model_type", "")) in IMPLICIT_ROPE_MODEL_TYPES:
        return
    if getattr(c, "kv_lora_rank", None) or any(
        getattr(c, a, None) is not None for a in ("rope_theta", "rope_parameters", "rope_scaling")
    ):
        return
    raise ConfigError(
        f"model {name}: {kind} has no rotary position embedding (its config names no rope_theta) and is not a "
        f"decoder-only family kvcodec knows without one ({', '.join(UNROTATED_MODEL_TYPES)}); kvcodec supports "
        "decoder-only language models (Llama, Qwen, Mistral, Gemma, Phi, GPT-2 families and the like); an encoder "
        "such as BERT keeps no KV cache to reuse"
    )


RECURRENT_STATE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state", "linear_num_value_heads")


def keeps_recurrent_state(config: Any) -> bool:
    """Whether a model's config (a multimodal one's text part) describes layers that keep a recurrent state."""
    return _recurrent(_text_config(config))


def _recurrent(c: Any) -> bool:
    """Whether a config describes layers that keep a recurrent state (Mamba, RWKV, their hybrids): by its
    layer types where it lists them (transformers names state-space layers linear_attention; a hybrid
    family's config of attention layers only sizes a state no layer keeps), else by the state's size or
    the family's name. Other layers that are not attention (LFM2's convolutions) are left to _cache_kinds."""
    types = getattr(c, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        return any(str(t).startswith("linear") or "mamba" in str(t) for t in types)
    kind = str(getattr(c, "model_type", "")).lower()
    return any(getattr(c, f, None) for f in RECURRENT_STATE_FIELDS) or "mamba" in kind or "rwkv" in kind


def layout_from_config(config: Any, name: str = "model") -> ModelLayout:
    """The ModelLayout a config describes; ConfigError / ShapeError with one line naming what is wrong."""
    c = _text_config(config)
    _refuse_architecture(config, c, name)
    layers = _int(c, "num_hidden_layers", name)
    heads = _int(c, "num_attention_heads", name)
    kv_heads = _int(c, "num_key_value_heads", name, heads)
    hidden = getattr(c, "hidden_size", None)
    head_dim = _int(c, "head_dim", name, hidden // heads if isinstance(hidden, int) else None)
    kinds = _cache_kinds(config, name)
    if len(kinds) != layers:
        raise ShapeError(f"model {name}: the config has {layers} layers, its cache {len(kinds)}")
    mla = getattr(c, "kv_lora_rank", None)
    specs, ropes = [], []
    for i, (kind, keep) in enumerate(kinds):
        if mla:
            rope_dim = _int(c, "qk_rope_head_dim", name)
            specs.append(LayerSpec("mla", (1, int(mla)), (1, rope_dim)))
            ropes.append(None)  # the decoupled key is coded as stored (its halves are separate streams)
            continue
        specs.append(LayerSpec(kind, (kv_heads, head_dim), (kv_heads, head_dim), keep))
        rope = _layer_rope(c, i, name)
        if rope is not None and rope.head_dim != head_dim:
            raise ConfigError(f"model {name}, layer {i}: RoPE over {rope.head_dim} dims, heads of {head_dim}")
        ropes.append(rope)
    dtype = str(getattr(c, "dtype", None) or getattr(c, "torch_dtype", None) or "float32").replace("torch.", "")
    spec = KVSpec(tuple(specs), dtype if dtype in ("float16", "bfloat16", "float32") else "float32")
    return ModelLayout(name, str(getattr(c, "model_type", "")), spec, tuple(ropes))


def inspect_model(name: str) -> ModelLayout:
    """Read and check a model's config (registered name, directory or .gguf): seconds, no weights."""
    return layout_from_config(model_config(name), name)


def check_cache_spec(layout: ModelLayout, spec: KVSpec) -> None:
    """Refuse a filled cache whose layers differ from what the config said (a config kvcodec misread)."""
    want = [(x.kind, x.k_shape, x.v_shape, x.keep) for x in layout.spec.layers]
    have = [(x.kind, x.k_shape, x.v_shape, x.keep) for x in spec.layers]
    if want != have:
        diff = next(i for i, (a, b) in enumerate(zip(want, have)) if a != b) if len(want) == len(have) else None
        where = f"layer {diff}: config {want[diff]}, cache {have[diff]}" if diff is not None else "layer counts"
        raise ShapeError(f"model {layout.name}: its cache differs from its config ({where})")


def check_codable(name: str) -> None:
    """Refuse, from its config in seconds and before its weights load, a model (registered name, folder
    or .gguf) whose KV cache kvcodec cannot code (models.check.inspect_model)."""
    try:
        inspect_model(name)
    except ShapeError as e:  # its words name the command's flags; the API's arguments too
        raise ShapeError(f"{e} (Engine(reuse=False, store_policy=StorePolicy(enabled=False)))") from e
