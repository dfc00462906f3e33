"""A test-only accelerator, "npu": torch's PrivateUse1 backend over host memory.

``load()`` compiles tests/npu/npu_ext.cpp with torch.utils.cpp_extension (once: the
build is cached under build/npu-ext/<torch version>, and rebuilt when the source
changes; about 15 s on two cores), renames PrivateUse1 to "npu", registers
``torch.npu`` and the ``Tensor.npu()`` family of methods.  From then on ``torch.device("npu:1")``,
``torch.accelerator``, ``torch.Event``, streams and ``pin_memory=True`` work as on a
machine with two accelerators; see npu_ext.cpp for what the device models
(asynchronous copies from pinned memory on per-stream worker threads, with a delay
``set_delay`` widens, so that a missing fence shows).

Registering a backend cannot be undone within a process, so the backend can be
switched off: ``enabled(False)`` makes it report no devices (``torch.npu.is_available()``
and ``torch.accelerator.is_available()`` are False, ``device_count()`` is 0), the
state of a CUDA build of torch on a machine without a GPU, in which the rest of a
test session then runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

NAME = "npu"
HERE = Path(__file__).resolve().parent
SOURCE = HERE / "npu_ext.cpp"
#: where the build goes: build/ at the repository root (git-ignored), or CKPTFMT_NPU_BUILD_DIR; one
#: folder per torch and Python (cpp_extension rebuilds when the source or flags change, not torch)
BUILD_DIR = Path(os.environ.get("CKPTFMT_NPU_BUILD_DIR") or HERE.parent.parent / "build" / "npu-ext") / (
    f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
)

_ext: Any = None


class UnavailableError(RuntimeError):
    """The extension cannot be built or registered here (no compiler, no ninja, another backend)."""


def why_not() -> str | None:
    """Why the extension cannot be built here, or None when it can be tried."""
    from torch.utils import cpp_extension

    if sys.platform != "linux":
        return f"the npu test extension is built on Linux only, not {sys.platform}"
    _ninja_on_path()
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja): torch.utils.cpp_extension.load needs it"
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", NAME):
        return f"the PrivateUse1 backend is already registered as {name!r}"
    return None


def _ninja_on_path() -> None:
    """Put a pip-installed ninja (in the virtual environment, whose bin/ need not be on PATH
    when Python is run as .venv/bin/python) on PATH for cpp_extension, which runs `ninja`."""
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for d in candidates:
        if os.access(os.path.join(d, "ninja"), os.X_OK):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def load(enable: bool = True) -> Any:
    """Build (or reuse the cached build of) the extension, register it as "npu" and return
    the compiled module; `enable` switches its devices on or off (see `enabled`)."""
    global _ext
    if _ext is None:
        problem = why_not()
        if problem is not None:
            raise UnavailableError(problem)
        if hasattr(torch, NAME):
            raise UnavailableError(f"torch.{NAME} exists already: {getattr(torch, NAME)!r}")
        from torch.utils import cpp_extension

        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        ext = cpp_extension.load(
            name="ckptfmt_npu_ext",
            sources=[str(SOURCE)],
            build_directory=str(BUILD_DIR),
            extra_cflags=["-O1", "-g0"],
            verbose=bool(os.environ.get("CKPTFMT_NPU_VERBOSE")),
        )
        torch.utils.rename_privateuse1_backend(NAME)
        torch._register_device_module(NAME, _device_module(ext))
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        _ext = ext
    _ext.set_enabled(enable)
    return _ext


def loaded() -> bool:
    return _ext is not None


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[Any]:
    """Switch the devices on (or off) for the duration of a with block."""
    before = _ext is not None and bool(_ext.enabled())
    ext = load(enable=on)
    try:
        yield ext
    finally:
        ext.set_enabled(before)


@contextlib.contextmanager
def delay(seconds: float) -> Iterator[None]:
    """Run each asynchronous copy `seconds` after it is issued, within the block."""
    assert _ext is not None, "load() first"
    before = _ext.delay_us()
    _ext.set_delay_us(round(seconds * 1e6))
    try:
        yield
    finally:
        _ext.set_delay_us(before)


def set_delay(seconds: float) -> None:
    assert _ext is not None, "load() first"
    _ext.set_delay_us(round(seconds * 1e6))


def stats() -> dict[str, int]:
    """Counters: asynchronous and synchronous copies, events recorded, event waits."""
    assert _ext is not None, "load() first"
    return dict(_ext.stats())


def _index(device: Any) -> int:
    if device is None:
        return int(_ext.current_device())
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != NAME:
        raise ValueError(f"expected an {NAME} device, got {d}")
    return int(_ext.current_device()) if d.index is None else int(d.index)


def _device_module(ext: Any) -> types.ModuleType:
    """torch.npu: what torch.accelerator, torch.get_device_module and rng.py call."""
    mod = types.ModuleType(f"torch.{NAME}")
    mod.__doc__ = "The npu test backend's device module (tests/npu)."

    def is_available() -> bool:
        return bool(ext.enabled())

    def device_count() -> int:
        return int(ext.device_count()) if ext.enabled() else 0

    def current_device() -> int:
        return int(ext.current_device())

    def set_device(device: Any) -> None:
        ext.set_device(_index(device))

    def synchronize(device: Any = None) -> None:
        ext.synchronize(_index(device))

    def get_rng_state(device: Any = NAME) -> torch.Tensor:
        return ext.default_generator(_index(device)).get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = NAME) -> None:
        ext.default_generator(_index(device)).set_state(new_state)

    def manual_seed(seed: int) -> None:
        ext.default_generator(current_device()).manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        for i in range(int(ext.device_count())):
            ext.default_generator(i).manual_seed(int(seed))

    def initial_seed() -> int:
        return int(ext.default_generator(current_device()).initial_seed())

    funcs = {
        "is_available": is_available,
        "device_count": device_count,
        "current_device": current_device,
        "set_device": set_device,
        "synchronize": synchronize,
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "initial_seed": initial_seed,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "_is_in_bad_fork": lambda: False,
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
    }
    for name, fn in funcs.items():
        setattr(mod, name, fn)
    return mod
