import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


# -- the npu test backend (tests/npu): a PrivateUse1 accelerator over host memory ----------------


@pytest.fixture(scope="session")
def npu_ext():
    """The npu test backend, built once per session (cached under build/npu-ext) and registered,
    with its devices switched off; use the `npu_devices` fixture to switch them on.

    Skips where it cannot be built (no C++ compiler or ninja), unless CKPTFMT_REQUIRE_NPU=1
    (CI) makes that a failure.
    """
    import npu

    problem = npu.why_not()
    if problem is None:
        try:
            return npu.load(enable=False)
        except Exception as e:  # a compiler error, missing headers
            problem = f"building the npu test extension failed: {str(e)[-2000:]}"
    if os.environ.get("CKPTFMT_REQUIRE_NPU"):
        pytest.fail(problem)
    pytest.skip(problem)


@pytest.fixture(scope="module")
def npu_devices(npu_ext):
    """The npu devices switched on for one test module, and off again after it: the rest of
    the session sees a backend without devices, like a CUDA build of torch without a GPU."""
    npu_ext.set_enabled(True)
    npu_ext.set_delay_us(0)
    try:
        yield npu_ext
    finally:
        npu_ext.synchronize(-1)
        npu_ext.set_delay_us(0)
        npu_ext.set_enabled(False)
