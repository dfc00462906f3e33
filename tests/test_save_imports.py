"""What a process's first save to a local file imports: the save path only, not the object-store
clients or the index parser.

Every module imported is paid for by that save (the import itself, and the collector's walk over
what it defines, some 10 ms on a busy 2-core machine for these): a training job's first
checkpoint, and each fresh process bench/run.py times a save in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ckptfmt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ckptfmt.__file__)))

_FIRST_SAVE = """
import json, sys
import torch
import ckptfmt
ckptfmt.save({"w": torch.ones(1024), "step": 3}, sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("ckptfmt"))))
"""

#: needed by s3://, gs:// and az:// saves, or by loads, never by a local save
NOT_FOR_A_LOCAL_SAVE = (
    "ckptfmt.storage.upload",
    "ckptfmt.storage.backends",
    "ckptfmt.storage.store",
    "ckptfmt.format.index",
    "ckptfmt.files.load",
)


def _modules_of_first_save(path: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_SAVE, path],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return modules


def test_a_local_save_imports_no_object_store_client_nor_the_index_parser(tmp_path):
    modules = _modules_of_first_save(str(tmp_path / "a.ckpt"))
    assert "ckptfmt.files.save" in modules and "ckptfmt.engine.chunkwrite" in modules
    assert [m for m in NOT_FOR_A_LOCAL_SAVE if m in modules] == []
    assert ckptfmt.load(tmp_path / "a.ckpt")["step"] == 3
