"""Callback states keyed by a class (``state_key`` returning a class, an older Lightning
pattern): stored under the class's ``__qualname__``, as Lightning keys its own, with the
classes recorded, and keyed by the class again on load where it is already imported."""

from __future__ import annotations

import sys
from typing import Any

from ...errors import CorruptError

#: the key under which callback states keyed by a class record that class: {qualname: module}
CLASS_KEYS_KEY = "__ckptfmt_callback_classes__"


def with_class_keys_named(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of `checkpoint` whose callback states keyed by a class are keyed by the
    class's ``__qualname__`` (Lightning's own key for a callback), with the classes recorded."""
    state = dict(checkpoint)
    callbacks = state.get("callbacks")
    if not isinstance(callbacks, dict) or not any(isinstance(k, type) for k in callbacks):
        return state
    renamed: dict[Any, Any] = {}
    classes: dict[str, str] = {}
    for key, value in callbacks.items():
        if isinstance(key, type):
            name = key.__qualname__
            if name in callbacks or name in classes:
                raise ValueError(
                    f"state['callbacks']: the class key {key!r} and another key are both named {name!r}"
                )
            classes[name] = key.__module__
            key = name
        renamed[key] = value
    state["callbacks"] = renamed
    state[CLASS_KEYS_KEY] = classes
    return state


def with_class_keys_restored(state: dict[str, Any], source: str) -> None:
    """Key the recorded callback states by their class again, where that class is already
    imported and is a class (nothing is imported: a name that does not resolve stays a str)."""
    classes = state.pop(CLASS_KEYS_KEY, None)
    if classes is None:
        return
    callbacks = state.get("callbacks")
    if not isinstance(classes, dict) or not isinstance(callbacks, dict):
        raise CorruptError(
            f"state[{CLASS_KEYS_KEY!r}] needs a dict and state['callbacks'] a dict", path=source
        )
    for name, module in classes.items():
        if type(name) is not str or type(module) is not str:
            raise CorruptError(f"state[{CLASS_KEYS_KEY!r}]: names and modules must be str", path=source)
        cls = _imported_class(module, name)
        if cls is not None and name in callbacks:
            callbacks[cls] = callbacks.pop(name)


def _imported_class(module: str, qualname: str) -> type | None:
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or part.startswith("__"):
            return None
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None
