"""A missing C engine is visible: a warning at first use, `ckptfmt info`, or an error on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# hides the compiled engine, as an install without a compiler or the zstd/xxhash headers would
_HIDE_ENGINE = textwrap.dedent(
    """
    import importlib.abc, sys
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "ckptfmt._ckptfmt_c":
                raise ImportError("engine hidden by the test")
            return None
    sys.meta_path.insert(0, Hide())
    """
)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CKPTFMT_BACKEND", "CKPTFMT_REQUIRE_ENGINE")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", _HIDE_ENGINE + code], capture_output=True, text=True, timeout=120, env=full
    )


def test_missing_engine_warns_once_at_first_use(tmp_path):
    code = f"""
import warnings, torch, ckptfmt
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ckptfmt.save({{"x": torch.arange(3)}}, {str(tmp_path / "a.ckpt")!r})
    ckptfmt.load({str(tmp_path / "a.ckpt")!r})
print(ckptfmt.backend(), sum("C engine is not built" in str(x.message) for x in w))
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "1"]


def test_require_engine_turns_the_missing_engine_into_an_error():
    out = _run("import ckptfmt", CKPTFMT_REQUIRE_ENGINE="1")
    assert out.returncode != 0
    assert "CKPTFMT_REQUIRE_ENGINE=1 but the C engine is not built" in out.stderr


def test_info_names_the_missing_engine():
    out = _run("import sys; from ckptfmt.cli import main; sys.exit(main(['info', '--json']))")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["backend"] == "python" and info["engine"].startswith("not built: ")


def test_forcing_the_python_path_does_not_warn(tmp_path):
    code = f"""
import warnings, torch, ckptfmt
warnings.simplefilter("error")
ckptfmt.save({{"x": torch.arange(3)}}, {str(tmp_path / "b.ckpt")!r})
print("ok")
"""
    out = _run(code, CKPTFMT_BACKEND="python")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
