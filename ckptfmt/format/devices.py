"""map_location: where each loaded storage goes.

The four forms and meanings of torch.load's ``map_location``:

* ``None``: every storage goes to the CPU (torch.load would restore the saved
  device instead; ckptfmt loads portably by default).
* a ``str`` or ``torch.device``: every storage goes there.
* a ``dict`` mapping saved location tags to new ones (``{"cuda:1": "cuda:0"}``):
  tags not in the dict keep their saved location, as in torch.load.
* a callable ``f(storage, location)`` that gets each storage on the CPU with its
  saved location tag and returns the storage to use, or None for the saved
  location.

Everything goes through torch's generic device calls, so CUDA and other
accelerators (privateuse1 backends such as NPUs, XPU, MPS) take one path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch

from .locations import MAX_DEVICE_INDEX

MapLocation = Union[
    None,
    str,
    torch.device,
    dict[str, Union[str, torch.device]],
    Callable[[torch.UntypedStorage, str], Union[torch.UntypedStorage, None]],
]


class DeviceError(ValueError):
    """A device string that torch cannot parse, or would parse as another device."""


def exact_device(text: str) -> torch.device:
    """torch.device(text), or DeviceError when torch would parse `text` as another device
    (an index above 127 wraps around) or not at all (a backend that is not installed)."""
    _, colon, index = text.rpartition(":")
    if colon and index.isdigit() and int(index) > MAX_DEVICE_INDEX:
        raise DeviceError(
            f"device {text[:60]!r}: torch cannot represent a device index above {MAX_DEVICE_INDEX}"
        )
    try:
        return torch.device(text)
    except RuntimeError as e:
        raise DeviceError(f"device {text[:60]!r} is unknown to torch here ({str(e)[:80]})") from None


def check_map_location(map_location: MapLocation) -> None:
    """Reject a malformed map_location before any file is read."""
    if map_location is None or callable(map_location):
        return
    if isinstance(map_location, torch.device):
        return
    if isinstance(map_location, str):
        exact_device(map_location)  # ValueError for a malformed or unrepresentable name
        return
    if isinstance(map_location, dict):
        for k, v in map_location.items():
            if not isinstance(k, str) or not isinstance(v, (str, torch.device)):
                raise TypeError(
                    "map_location dict must map location strings to str or torch.device, got "
                    f"{type(k).__name__}: {type(v).__name__}"
                )
            if isinstance(v, str):
                exact_device(v)
        return
    raise TypeError(
        "map_location must be None, a str, a torch.device, a dict or a callable, "
        f"not {type(map_location).__name__}"
    )


def planned_device(map_location: MapLocation, location: str) -> torch.device | None:
    """The target device when it is known before reading; None when a callable decides.

    ValueError when the target is a saved location that torch does not know here (a
    backend that is not installed): map it elsewhere with map_location.
    """
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, torch.device):
        return map_location
    if isinstance(map_location, str):
        return exact_device(map_location)
    if isinstance(map_location, dict):
        target = map_location.get(location, location)
        return target if isinstance(target, torch.device) else exact_device(target)
    return None


def move(storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """Copy a CPU storage to `device` (no copy when it is the CPU already)."""
    if device.type == "cpu":
        return storage
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat.to(device).untyped_storage()


def apply_callable(
    fn: Callable[[torch.UntypedStorage, str], torch.UntypedStorage | None],
    storage: torch.UntypedStorage,
    location: str,
) -> torch.UntypedStorage:
    result = fn(storage, location)
    if result is None:
        return move(storage, exact_device(location))
    if isinstance(result, torch.TypedStorage):
        result = result.untyped()
    if not isinstance(result, torch.UntypedStorage):
        raise TypeError(f"map_location callable returned {type(result).__name__}, expected a storage or None")
    if result.nbytes() != storage.nbytes():
        raise ValueError(
            f"map_location callable returned a storage of {result.nbytes()} bytes "
            f"for one of {storage.nbytes()}"
        )
    return result
