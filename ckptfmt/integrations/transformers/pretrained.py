"""``from_pretrained`` on ckptfmt's ``checkpoint-N`` folders: :func:`enable` wraps
``PreTrainedModel.from_pretrained`` (which ``AutoModel...from_pretrained`` and pipelines call)
so that a local folder holding a ckptfmt commit record and no weights of transformers' own
(``model.safetensors``, ``pytorch_model.bin``, their sharded indexes) is read through
ckptfmt: ``model.ckpt`` checked against the commit record (length, file id, index checksum,
every chunk's checksum), then handed to the original ``from_pretrained`` as its
``state_dict`` with the folder's config (``config.json``, which the commit record does not
cover, read as :func:`load_model` reads it: through the folder, bounded, never through a link
or from a FIFO; a folder without one is an IncompleteError, not transformers' default config).
When a config object is given (``AutoModel...`` and pipelines give the one AutoConfig read),
the folder's ``config.json``, if it has one, is still read through the folder and a link, a
FIFO or an oversize file refused, but its model type is not judged (the given object is used).
``AutoModel...from_pretrained`` and ``AutoConfig.from_pretrained`` (which ``pipeline()`` calls
before any model class is reached) read it so, as a JSON object, before transformers opens it:
a link, a FIFO, an oversize file are refused there.  Keyword arguments go where transformers
sends them: those the config holds to the config, the rest to the model.  Every other call goes to transformers unchanged."""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
from typing import Any

from ...engine.ckptdir import CheckpointDir
from ...errors import CorruptError
from ...files import multifile, recordsign
from .models import read_config_bytes, read_config_values, read_config_with
from .names import CONFIG_JSON, MAX_JSON_BYTES, MODEL_NAME
from .reading import load_model_state, why

#: the generation settings transformers writes beside a model's config
GENERATION_JSON = "generation_config.json"

#: transformers' own weight files: a folder holding one is left to transformers
HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

_LOCK = threading.Lock()
_ORIGINAL: Any = None
_ORIGINAL_AUTO: dict[type, Any] = {}  # each Auto model class's own from_pretrained, AutoConfig's
_KEYS: dict[str, Any] = {}


def _forget_in_child() -> None:
    """A forked child keeps the hook and its keys; the lock may have been held at the fork."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def is_ckptfmt_folder(path: Any) -> bool:
    """Whether `path` is a local folder with a ckptfmt commit record and ``model.ckpt`` and
    none of transformers' own weight files (links are not followed inside it)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        with CheckpointDir.open(path) as folder:
            return (
                folder.exists(multifile.COMMIT_NAME)
                and folder.exists(MODEL_NAME)
                and not any(folder.exists(n) for n in HF_WEIGHTS)
            )
    except (OSError, ValueError):  # not a directory, no such path; CheckpointError is a ValueError
        return False


#: what transformers' from_pretrained (5.x) takes out of its ``**kwargs`` for itself before it
#: reads a config: these stay with it, never applied to the config (``dtype`` is also a config
#: attribute, and transformers applies it its own way)
FROM_PRETRAINED_OWN = frozenset(
    {
        "state_dict", "proxies", "tqdm_class", "output_loading_info", "_from_pipeline", "_from_auto",
        "dtype", "torch_dtype", "device_map", "max_memory", "offload_folder", "offload_buffers",
        "quantization_config", "subfolder", "_commit_hash", "variant", "adapter_kwargs", "adapter_name",
        "generation_config", "gguf_file", "distributed_config", "device_mesh", "tp_plan", "tp_size",
        "trust_remote_code", "allow_all_kernels", "use_kernels", "kernel_config", "key_mapping",
        "mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict",
        "attn_implementation", "experts_implementation",
    }
)  # fmt: skip

#: what transformers hands a config's own from_pretrained to find it (a config given as a path)
_DOWNLOAD_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "proxies",
    "subfolder",
)


def _config_overrides(original: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take out of `kwargs` what transformers' from_pretrained would offer its config (those of
    its keyword arguments that are neither its own parameters nor FROM_PRETRAINED_OWN)."""
    own = set(inspect.signature(original.__func__).parameters) | FROM_PRETRAINED_OWN
    return {k: kwargs.pop(k) for k in list(kwargs) if k not in own}


def _folder_config(cls: Any, path: str, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The model config of folder `path`, read as load_model reads it: ``config.json`` through
    the folder (no link followed, no FIFO waited on, bounded), of a model type transformers or
    the class knows; IncompleteError when missing (transformers would build its default config
    and load the committed weights into that), CorruptError when it is not one.  The caller's
    `overrides` are applied as transformers applies them; those the config does not hold are
    returned, for the model."""
    with CheckpointDir.open(path) as folder:
        config, unused = read_config_with(folder, cls, overrides)
    config.name_or_path = path  # as transformers' from_pretrained records it
    return config, unused


def _given_config(
    cls: Any, config: Any, overrides: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """The caller's own config, a path (wherever it is) read by the class's config class with
    `overrides` applied, as transformers reads it; the overrides it does not hold, for the model."""
    download = {k: kwargs[k] for k in _DOWNLOAD_KWARGS if k in kwargs}
    made, unused = cls.config_class.from_pretrained(
        config, return_unused_kwargs=True, **download, **overrides
    )
    return made, unused


def _check_folder_config_file(path: str) -> None:
    """A config object was given: ``AutoModel...from_pretrained`` and ``pipeline()`` give the
    one AutoConfig read from the folder's ``config.json``, following links (transformers marks
    that path with keyword arguments it consumes before this hook sees them).  So whenever the
    folder holds a ``config.json`` it is read again through the folder: a link, a FIFO or an
    oversize file is refused (CheckpointError naming it) rather than used.  Its contents are
    not judged: the given object is what is used (AutoConfig applied the caller's keyword
    overrides to it), and a caller's own config is the way to load a folder whose model type
    this transformers does not know."""
    with CheckpointDir.open(path) as folder:
        if folder.lstat(CONFIG_JSON) is not None:
            read_config_bytes(folder)


def _record_name(model: Any, path: str) -> None:
    """transformers' from_pretrained, called with no path, records None as the model's name."""
    model.config.name_or_path = path
    if hasattr(model, "name_or_path"):
        model.name_or_path = path


def _from_ckptfmt_folder(
    original: Any, cls: Any, path: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    path = os.fspath(path)
    if kwargs.get("subfolder"):  # the weights read are the folder's own: never another's silently
        raise ValueError(
            f"from_pretrained({path!r}, subfolder={kwargs['subfolder']!r}): {path} is a ckptfmt "
            "checkpoint folder, whose model is its own model.ckpt; pass the subfolder's path instead"
        )
    config = kwargs.pop("config", None)
    if config is None:  # transformers then offers the config the keywords not its own
        config, for_model = _folder_config(cls, path, _config_overrides(original, kwargs))
        kwargs.update(for_model)
    elif isinstance(config, (str, os.PathLike)):  # the caller's own config, wherever it is
        config, for_model = _given_config(cls, config, _config_overrides(original, kwargs), kwargs)
        kwargs.update(for_model)
    else:  # a config object: every keyword goes to the model, as transformers sends them
        _check_folder_config_file(path)
    state = load_model_state(path, decrypt_with=_KEYS.get("decrypt"), trusted_keys=_KEYS.get("trusted"))
    loaded = original.__func__(cls, None, *args, config=config, state_dict=state, **kwargs)
    # output_loading_info=True: (model, info), as transformers returns it
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    _record_name(model, path)
    if getattr(model, "can_generate", None) and model.can_generate():
        generation = _folder_generation_config(path)
        if generation is not None:
            model.generation_config = generation
    return loaded


def _folder_generation_config(path: str) -> Any:
    """The folder's ``generation_config.json`` (None when it has none), read through the folder
    as its config is: bounded, never through a link or from a FIFO (CheckpointError naming it)."""
    from transformers import GenerationConfig

    with CheckpointDir.open(path) as folder:
        if folder.lstat(GENERATION_JSON) is None:
            return None
        raw = folder.read_file(GENERATION_JSON, MAX_JSON_BYTES)
    try:
        values = json.loads(raw)
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
        generation = GenerationConfig.from_dict(values)
    except (ValueError, TypeError, RecursionError) as e:
        raise CorruptError(
            f"{GENERATION_JSON} is not a generation config: {why(e)[:200]}", path=path
        ) from None
    # as GenerationConfig.from_pretrained does: save_pretrained then only warns about values
    # transformers finds doubtful, unless the model's code changed them since
    generation._original_object_hash = hash(generation)
    return generation


def enable(*, decrypt_with: Any = None, trusted_keys: Any = None) -> None:
    """Make ``from_pretrained(folder)`` (any model class, ``AutoModel...``, pipelines) open
    ckptfmt ``checkpoint-N`` folders, checked as :func:`load_model_state` checks them.
    `decrypt_with`: the key of encrypted folders; `trusted_keys`: Ed25519 public keys, one of
    which must have signed a folder's commit record.  Calling it again replaces the keys."""
    global _ORIGINAL
    from transformers import PreTrainedModel

    with _LOCK:
        _KEYS.update(decrypt=decrypt_with, trusted=recordsign.public_keys(trusted_keys))
        if _ORIGINAL is not None:
            return
        original = PreTrainedModel.__dict__["from_pretrained"]

        @functools.wraps(original.__func__)
        def from_pretrained(
            cls: Any, pretrained_model_name_or_path: Any = None, *args: Any, **kwargs: Any
        ) -> Any:
            if is_ckptfmt_folder(pretrained_model_name_or_path):
                return _from_ckptfmt_folder(original, cls, pretrained_model_name_or_path, args, kwargs)
            return original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)

        PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment,method-assign]
        _ORIGINAL = original
        _hook_auto_classes()
        _hook_auto_config()


def _hook_auto_config() -> None:
    """``pipeline(model=folder)`` reads ``config.json`` with ``AutoConfig.from_pretrained``
    before any model class is reached (following links, from a FIFO as from a file): on a
    ckptfmt folder the file is read first through the folder, bounded, and must be a JSON
    object, as for the Auto model classes (``_checking_config_first``)."""
    from transformers import AutoConfig

    original = AutoConfig.__dict__.get("from_pretrained")
    if isinstance(original, classmethod) and AutoConfig not in _ORIGINAL_AUTO:
        AutoConfig.from_pretrained = classmethod(_checking_config_first(original))  # type: ignore[assignment,method-assign]
        _ORIGINAL_AUTO[AutoConfig] = original


def _hook_auto_classes() -> None:
    """``AutoModel...from_pretrained`` reads ``config.json`` with AutoConfig (following links,
    whole, from a FIFO as from a file) before any model class is reached: on a ckptfmt folder
    the file is read first through the folder, bounded, and must be a JSON object; the model
    type it names is left to AutoConfig and to the concrete class (an Auto class has no config
    class, and a type reached through ``auto_map`` only the folder's code knows).  transformers
    gives each Auto class its own copy of the method: each is wrapped."""
    from transformers import AutoModel  # noqa: F401  every Auto model class defined
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    todo = [_BaseAutoModelClass]
    while todo:
        auto = todo.pop()
        todo.extend(auto.__subclasses__())
        original = auto.__dict__.get("from_pretrained")
        if isinstance(original, classmethod) and auto not in _ORIGINAL_AUTO:
            auto.from_pretrained = classmethod(_checking_config_first(original))  # type: ignore[assignment,method-assign]
            _ORIGINAL_AUTO[auto] = original


def _checking_config_first(original: Any) -> Any:
    @functools.wraps(original.__func__)
    def from_pretrained(
        cls: Any, pretrained_model_name_or_path: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        if kwargs.get("config") is None and is_ckptfmt_folder(pretrained_model_name_or_path):
            # only how the file is read: an Auto class (AutoConfig too) has no config class to
            # judge its model type by (one reached through auto_map is known to the folder's code)
            with CheckpointDir.open(os.fspath(pretrained_model_name_or_path)) as folder:
                read_config_values(folder)
        return original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)

    return from_pretrained


def disable() -> None:
    """Undo :func:`enable`: ``from_pretrained`` is transformers' own again."""
    global _ORIGINAL
    from transformers import PreTrainedModel

    with _LOCK:
        if _ORIGINAL is not None:
            PreTrainedModel.from_pretrained = _ORIGINAL  # type: ignore[method-assign]
            _ORIGINAL = None
            _KEYS.clear()
        for auto, original in _ORIGINAL_AUTO.items():
            auto.from_pretrained = original  # type: ignore[attr-defined]
        _ORIGINAL_AUTO.clear()
