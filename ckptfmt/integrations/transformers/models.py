"""Building a model from a ``checkpoint-N`` folder: its ``config.json`` (which the commit record
does not cover) is read bounded and made into a model on the meta device first, which must
match the tensors of the committed ``model.ckpt`` before anything is allocated."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Iterator
from typing import Any

from ...engine.ckptdir import CheckpointDir
from ...errors import (
    CorruptError,
    IncompleteError,
    UnsupportedError,
)
from ...files import recordsign
from ...files.reader import CheckpointFile
from .names import (
    CONFIG_JSON,
    MAX_JSON_BYTES,
    MODEL_NAME,
)
from .reading import open_checked, why


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception of transformers or torch (about a hostile config) in one bounded line."""
    text = " ".join(why(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _config_class(cls: Any, model_type: Any, where: str) -> Any:
    """The config class for `model_type`: the model class's own ``config_class`` when it
    subclasses the config transformers registers for the type, or when the type is not one
    transformers registers (or is not given) and the class's config is of that type; else
    transformers' registered one; UnsupportedError when neither is."""
    import transformers
    from transformers import CONFIG_MAPPING, PretrainedConfig

    own = getattr(cls, "config_class", None)
    own = own if isinstance(own, type) and issubclass(own, PretrainedConfig) else None
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        registered = CONFIG_MAPPING[model_type]
        if own is not None and issubclass(own, registered):  # keeps the subclass's attributes
            return own
        if own is None or not own.model_type or own.model_type == model_type:
            return registered
    if own is not None and (not model_type or own.model_type == model_type):
        return own
    if not isinstance(model_type, str) or not model_type:
        raise CorruptError(
            f"{CONFIG_JSON} is not a model config: no model_type (give the model class, whose "
            "config_class reads it)",
            path=where,
        )
    named = "" if own is None else f", nor of {cls.__name__}'s config class ({own.model_type!r})"
    raise UnsupportedError(
        f"{CONFIG_JSON}: model_type {model_type[:80]!r} is not a model type transformers "
        f"{transformers.__version__} knows{named}",
        path=where,
    )


def read_config_bytes(folder: CheckpointDir) -> bytes:
    """The bytes of ``config.json``, read through the folder: a link or anything but a regular
    file is refused (CheckpointError), never followed or waited on; LimitError past
    MAX_JSON_BYTES; IncompleteError when there is none."""
    try:
        return folder.read_file(CONFIG_JSON, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise IncompleteError(f"{CONFIG_JSON} is missing", path=folder.path) from None


def read_config_values(folder: CheckpointDir) -> dict[str, Any]:
    """``config.json`` as read by :func:`read_config_bytes`, which must be a JSON object
    (CorruptError); which model type it names is not looked at."""
    raw = read_config_bytes(folder)
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError included; nested too deep
        raise CorruptError(f"{CONFIG_JSON} is not JSON: {_one_line(e)}", path=folder.path) from None
    if not isinstance(values, dict):
        raise CorruptError(f"{CONFIG_JSON} is not a model config: not an object", path=folder.path)
    return values


def read_config(folder: CheckpointDir, cls: Any) -> Any:
    """The model config in ``config.json``, read through the folder (no link, no FIFO, bounded).
    The commit record does not cover it: any value that does not make a config of a model type
    transformers knows, or of the model class's own ``config_class``, is refused
    (UnsupportedError for an unknown type, else CorruptError)."""
    return read_config_with(folder, cls, {})[0]


def read_config_with(
    folder: CheckpointDir, cls: Any, overrides: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """:func:`read_config`'s config with the caller's keyword `overrides` applied as
    transformers' ``from_pretrained`` applies them (``from_dict``: those the config holds
    set on it), and the overrides it does not hold, which go to the model.  The file is
    judged alone first: an override the config refuses is transformers' own error, not the
    file's."""
    values = read_config_values(folder)
    model_type = values.get("model_type")
    config_class = _config_class(cls, model_type, folder.path)
    try:
        config = config_class.from_dict(copy.deepcopy(values))
    except Exception as e:  # transformers' and huggingface_hub's validation errors, any kind
        raise CorruptError(
            f"{CONFIG_JSON} is not a {config_class.model_type or config_class.__name__} config: "
            f"{_one_line(e)}",
            path=folder.path,
        ) from None
    if not overrides:
        return config, {}
    config, unused = config_class.from_dict(values, return_unused_kwargs=True, **overrides)
    return config, unused


def _committed_tensors(f: CheckpointFile, where: str) -> dict[str, tuple[list[int], Any]]:
    """name -> (shape, dtype) of the tensors of ``model.ckpt``, from its index (no data read)."""
    from ...format import dtypes

    node = f.tree.nodes[f.tree.root]
    if node[0] not in ("dict", "odict"):
        raise CorruptError(f"{MODEL_NAME} does not hold a state dict", path=where)
    out: dict[str, tuple[list[int], Any]] = {}
    for key, nid in f.root_items():
        entry = f.tree.nodes[nid]
        if type(key) is not str or entry[0] != "tensor":
            raise CorruptError(f"{MODEL_NAME}: {str(key)[:80]!r} is not a named tensor", path=where)
        out[key] = (list(entry[1]["shape"]), dtypes.TORCH_DTYPES[entry[1]["dtype"]])
    return out


#: a model built from a config may register at most this many modules, parameters and buffers
#: per committed tensor (plus SLACK) before it is stopped: a hostile layer count cannot make
#: even the meta model take unbounded time and memory
MODULES_PER_TENSOR = 16
SLACK = 1024


class _TooBig(Exception):
    pass


@contextlib.contextmanager
def _bounded(limit: int) -> Iterator[None]:
    """Stop a model's construction (in this thread) once it registers more than `limit`
    modules, parameters and buffers."""
    from torch.nn.modules import module as torch_module

    me = threading.get_ident()
    count = [0]

    def hook(*_args: Any) -> None:
        if threading.get_ident() == me:
            count[0] += 1
            if count[0] > limit:
                raise _TooBig(f"more than {limit} modules, parameters and buffers")

    handles = [
        torch_module.register_module_module_registration_hook(hook),
        torch_module.register_module_parameter_registration_hook(hook),
        torch_module.register_module_buffer_registration_hook(hook),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _build(cls: Any, config: Any) -> Any:
    return cls.from_config(config) if hasattr(cls, "from_config") else cls(config)


def _meta_model(cls: Any, config: Any, limit: int, where: str) -> Any:
    """The model `config` makes, built on the meta device (nothing allocated); CorruptError when
    transformers or torch refuse the config."""
    import torch

    mapping = getattr(cls, "_model_mapping", None)  # an AutoModel... class
    if mapping is not None and type(config) not in mapping:
        raise UnsupportedError(
            f"{CONFIG_JSON}: {getattr(cls, '__name__', cls)} has no model for model_type "
            f"{config.model_type!r}",
            path=where,
        )
    try:
        with _bounded(limit), torch.device("meta"):
            return _build(cls, copy.deepcopy(config))
    except Exception as e:  # whatever the model's code raises on the values it was given
        raise CorruptError(f"{CONFIG_JSON} does not make a model: {_one_line(e)}", path=where) from None


def _misfit(model: Any, committed: dict[str, tuple[list[int], Any]]) -> str | None:
    """How the model's state dict differs from the committed tensors (names, shapes, dtypes)."""
    import torch

    own = model.state_dict()
    missing = [k for k in own if k not in committed]
    if missing:
        return f"{MODEL_NAME} has no {missing[0][:120]!r} ({len(missing)} of the model's tensors missing)"
    extra = [k for k in committed if k not in own]
    if extra:
        return f"{MODEL_NAME} holds {extra[0][:120]!r}, which the model has not ({len(extra)} such)"
    for k, t in own.items():
        shape, dtype = committed[k]
        if not isinstance(t, torch.Tensor):
            return f"the model's {k[:120]!r} is not a tensor"
        if list(t.shape) != shape or t.dtype != dtype:
            return f"{k[:120]!r} is {dtype} {shape} in {MODEL_NAME}, {t.dtype} {list(t.shape)} in the model"
    return None


def _nbytes(shape: list[int], dtype: Any) -> int:
    import math

    import torch

    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def load_model(
    path: str, model_class: Any = None, *, decrypt_with: Any = None, trusted_keys: Any = None
) -> Any:
    """A model built from a complete checkpoint folder: its ``config.json`` and ``model.ckpt``.

    `model_class`: an ``AutoModel...`` class (default ``AutoModel``) or a model class
    (``GPT2LMHeadModel``, or your own ``PreTrainedModel`` subclass: its ``config_class`` reads
    a ``config.json`` whose model_type transformers does not register, or that has none).  The model is on the CPU, in training mode as saved.
    `decrypt_with`: the key of an encrypted checkpoint (spec section 17); `trusted_keys`:
    Ed25519 public keys, one of which must have signed the folder's commit record (spec
    16.7): ``model.ckpt`` is hashed against it before its index is read.

    ``config.json`` is not covered by the commit record: the model it makes is first built on
    the meta device (nothing allocated) and every parameter and buffer of its state dict
    compared (name, shape, dtype) with the tensors ``model.ckpt`` holds, read from its index;
    any difference is a CorruptError (a model type transformers does not know: UnsupportedError)
    before anything is allocated.  Only then is the model built on the CPU (its buffers that
    are not in the state dict, such as BERT's ``position_ids``, made by the model's own code)
    and the committed tensors loaded into it.
    """
    from transformers import AutoModel

    cls = AutoModel if model_class is None else model_class
    with open_checked(path, False, recordsign.public_keys(trusted_keys), decrypt_with) as opened:
        part = opened.part(MODEL_NAME)
        if part is None:
            raise IncompleteError(f"the commit record names no {MODEL_NAME}", path=opened.path)
        config = read_config(opened.dir, cls)
        with opened.open(part) as f:
            committed = _committed_tensors(f, opened.path)
            limit = MODULES_PER_TENSOR * len(committed) + SLACK
            skeleton = _meta_model(cls, config, limit, opened.path)
            why = _misfit(skeleton, committed)
            if why is not None:
                raise CorruptError(f"{CONFIG_JSON} does not fit the committed model: {why}", path=opened.path)
            held = sum(_nbytes(*v) for v in committed.values())
            own = set(skeleton.state_dict())
            more = sum(b.numel() * b.element_size() for n, b in skeleton.named_buffers() if n not in own)
            if more > held + (1 << 20):
                raise CorruptError(
                    f"{CONFIG_JSON} makes {more} bytes of buffers that are not in {MODEL_NAME} "
                    f"(which holds {held} bytes)",
                    path=opened.path,
                )
            del skeleton
            state = f.load_subtree(f.tree.root, None, True)
    # the same config, now on the CPU: its tensors are those just checked
    model: Any = _build(cls, config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # pragma: no cover - the meta model was checked to fit
        raise CorruptError(f"{MODEL_NAME} does not fit the model: {_one_line(e)}", path=path) from None
    return model
