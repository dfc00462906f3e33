"""The shape of the package: layers that import downwards only, no import cycles, and
readers that do not import the writer.

Imports are read from the source (module level and inside functions alike), so an
upward or cyclic import hidden in a function is found too; imports only a type
checker runs (``if TYPE_CHECKING:``) are left out of the layer rules, but not of the
search for cycles: a module that names another's type and is imported by it (inside a
function or not) depends on it both ways.  ``from . import __version__``
is an edge to the package's ``__init__``, which defines the version before
importing anything; edges into ``__init__`` are therefore left out of the graph
and checked on their own.
"""

from __future__ import annotations

import ast
import json
import os

import pytest
from helpers import forge_state_file

import ckptfmt

ROOT = os.path.dirname(os.path.abspath(ckptfmt.__file__))

#: the layers, lowest first: a module may import its own layer and the layers before it
LAYERS = [
    "base",
    "format",
    "engine",
    "storage",
    "background",
    "files",
    "dcp",
    "runs",
    "integrations",
    "cli",
    "demo",
]
#: the base layer: leaves every layer uses
BASE = {"ckptfmt.errors", "ckptfmt.fileio", "ckptfmt.gcpause"}
#: the public face, which imports every library layer to re-export its names
FACE = {"ckptfmt", "ckptfmt.__main__"}

#: the save path and the modules that wait for saves: no cycle may pass through them
SAVE_PATH = [
    "ckptfmt.engine.bytesview",
    "ckptfmt.engine.commit",
    "ckptfmt.background.inflight",
    "ckptfmt.background.staging",
    "ckptfmt.engine.chunkwrite",
    "ckptfmt.background.copysave",
    "ckptfmt.files.save",
    "ckptfmt.files.load",
    "ckptfmt.files.verify",
    "ckptfmt.files.load_into",
]


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3]
                name = rel.replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _walk_runtime(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _graph(module_level_only: bool, typing_too: bool = False) -> dict[str, set[str]]:
    """Each module's imports of the package: at module level only, or anywhere (inside
    functions too); with `typing_too`, those under ``if TYPE_CHECKING:`` as well."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        if module_level_only:
            nodes: list[ast.AST] = list(tree.body)
        else:
            nodes = list(ast.walk(tree)) if typing_too else _walk_runtime(tree)
        deps: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for alias in node.names:
                    full = f"{mod}.{alias.name}"
                    deps.add(full if full in mods else mod)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name and d != "ckptfmt"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _layer(module: str) -> str:
    if module in BASE:
        return "base"
    parts = module.split(".")
    assert len(parts) >= 2 and parts[1] in LAYERS, f"{module} is in no layer: put it in a layer's folder"
    return parts[1]


def test_every_module_is_in_a_layer():
    for name in _modules():
        if name not in FACE:
            _layer(name)


def test_imports_go_down_the_layers():
    upward = []
    for name, deps in _graph(module_level_only=False).items():
        if name in FACE:
            continue
        for dep in deps:
            if dep not in FACE and LAYERS.index(_layer(dep)) > LAYERS.index(_layer(name)):
                upward.append(f"{name} -> {dep}")
    assert upward == []


def _root_names(path: str, package: str) -> set[str]:
    """The names a module takes from ``ckptfmt`` itself (``from .. import x``, ``import ckptfmt``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out: set[str] = set()
    for node in _walk_runtime(tree):
        if isinstance(node, ast.ImportFrom):
            target = (
                node.module
                if not node.level
                else ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([node.module] if node.module else [])
                )
            )
            if target == "ckptfmt":
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import) and any(alias.name == "ckptfmt" for alias in node.names):
            out.add("*")
    return out


def test_library_layers_take_only_the_version_from_the_public_face():
    """``ckptfmt/__init__`` imports the library layers; they may use only the version it defines
    first.  Integrations, the CLI and the demo use the public API as users do."""
    for name, path in _modules().items():
        if name in FACE or LAYERS.index(_layer(name)) >= LAYERS.index("integrations"):
            continue
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        taken = (
            _root_names(path, package)
            - {"__version__"}
            - {n for n in _root_names(path, package) if f"ckptfmt.{n}" in _modules()}
        )
        assert taken == set(), f"{name} takes {sorted(taken)} from the public face"


def test_layer_folders_import_nothing_when_entered():
    """A layer's ``__init__`` is a docstring, so importing one module of a layer does not drag in
    the rest (readers import ``background.inflight`` without the background writer)."""
    for layer in ["format", "engine", "storage", "background", "files", "runs", "demo"]:
        with open(os.path.join(ROOT, layer, "__init__.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        assert [type(n).__name__ for n in tree.body] == ["Expr"], layer


def test_every_relative_import_names_a_module_of_the_package():
    """A relative import that resolves to nothing fails only when its function runs (mypy and
    the graph above would both pass it by); the built engine is the one module without source."""
    mods = _modules()
    unresolved = []
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    unresolved.append(f"{name}:{node.lineno}")
                    continue
                base = parts[: len(parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if target not in mods and target != "ckptfmt._ckptfmt_c":
                    unresolved.append(f"{name}:{node.lineno}: {target}")
    assert unresolved == []


def test_no_import_cycle_anywhere():
    assert _cycles(_graph(module_level_only=False)) == []


def test_no_cycle_even_through_imports_inside_functions_or_for_types():
    """Every import counts: inside functions, and those only a type checker runs.  A step saved
    across ranks (runs/sharded.py) reaches its run through the step-saving protocol
    (runs/stepsave.py), not the manager's private methods."""
    graph = _graph(module_level_only=False, typing_too=True)
    assert _cycles(graph) == []
    assert "ckptfmt.runs.manager" not in _reach(graph, "ckptfmt.runs.sharded")


def test_module_level_imports_have_no_cycle():
    assert _cycles(_graph(module_level_only=True)) == []


def test_no_cycle_passes_through_the_save_path():
    graph = _graph(module_level_only=False)
    assert set(SAVE_PATH) <= set(graph)
    for comp in _cycles(graph):
        assert not set(comp) & set(SAVE_PATH), comp


@pytest.mark.parametrize(
    "reader",
    ["ckptfmt.files.load", "ckptfmt.files.verify", "ckptfmt.files.load_into", "ckptfmt.background.inflight"],
)
def test_readers_do_not_import_the_writer(reader):
    reached = _reach(_graph(module_level_only=False), reader)
    writer = {
        "ckptfmt.files.save",
        "ckptfmt.background.copysave",
        "ckptfmt.engine.chunkwrite",
        "ckptfmt.engine.commit",
    }
    assert not reached & writer


def test_the_commit_protocol_and_the_registry_import_nothing_of_ckptfmt():
    """...but the commit protocol works inside a directory through the one module that owns
    filesystem operations there, which imports nothing but the errors; the registry of saves
    in flight imports only fileio (which tells an object-store URL from a path) and the errors
    (its waits' DeadlineError)."""
    graph = _graph(module_level_only=False)
    assert graph["ckptfmt.engine.commit"] == {"ckptfmt.engine.ckptdir", "ckptfmt.errors"}
    assert graph["ckptfmt.engine.ckptdir"] == {"ckptfmt.errors", "ckptfmt.fileio"}
    assert graph["ckptfmt.background.inflight"] == {"ckptfmt.errors", "ckptfmt.fileio"}
    assert graph["ckptfmt.engine.bytesview"] == set()


def test_the_graph_reader_sees_a_cycle(tmp_path):
    """The check itself can fail: a cycle made of two modules is found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_layer_check_sees_an_upward_import():
    """...and so can the layer rule: a format module importing the engine is in a higher layer."""
    assert LAYERS.index(_layer("ckptfmt.engine.native")) > LAYERS.index(_layer("ckptfmt.format.tree"))
    with pytest.raises(AssertionError, match="in no layer"):
        _layer("ckptfmt.loose")


# -- modules small enough to read ----------------------------------------------------------------

#: no module of the package is longer than this many lines: a longer one is split where its
#: concepts part (issue 33)
MAX_MODULE_LINES = 700
#: modules still longer, each with the work that splits it (none)
LONG_MODULES: dict[str, str] = {}


def _module_lengths() -> dict[str, int]:
    out = {}
    for path in _modules().values():
        with open(path, encoding="utf-8") as f:
            out[os.path.relpath(path, os.path.dirname(ROOT))] = sum(1 for _ in f)
    return out


def test_no_module_is_longer_than_the_limit():
    lengths = _module_lengths()
    long = {p: n for p, n in lengths.items() if n > MAX_MODULE_LINES and p not in LONG_MODULES}
    assert long == {}, f"split these where their concepts part: {long}"


def test_the_length_check_counts_every_module():
    """The check itself can fail: it sees every module, each as long as it is."""
    lengths = _module_lengths()
    assert len(lengths) == len(_modules())
    with open(os.path.join(ROOT, "runs", "manager.py"), encoding="utf-8") as f:
        assert lengths[os.path.join("ckptfmt", "runs", "manager.py")] == len(f.read().splitlines())


# -- public calls take only public parameters -----------------------------------------------------

#: the public faces whose names (``__all__``) users call
PUBLIC = ["ckptfmt", "ckptfmt.dcp", "ckptfmt.integrations.lightning", "ckptfmt.integrations.transformers"]
#: parameters a framework's own signature fixes (an override must keep them)
FRAMEWORK_PARAMETERS = {"ckptfmt.integrations.transformers.CkptfmtTrainerMixin.save_model(_internal_call)"}


def _private_parameters() -> list[str]:
    """``module.name(parameter)`` for each parameter starting with ``_`` of a public function,
    class constructor or public method."""
    import importlib
    import inspect

    def private(qual: str, fn: object) -> list[str]:
        try:
            names = inspect.signature(fn).parameters  # type: ignore[arg-type]
        except (TypeError, ValueError):  # a builtin without a signature
            return []
        return [f"{qual}({p})" for p in names if p.startswith("_")]

    found = []
    for module in PUBLIC:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, type):
                for attr, value in vars(obj).items():
                    if callable(value) and (attr == "__init__" or not attr.startswith("_")):
                        found += private(f"{module}.{name}.{attr}", value)
            elif callable(obj):
                found += private(f"{module}.{name}", obj)
    return found


def test_no_public_call_takes_a_private_parameter():
    """ckptfmt's own callers (the manager, the DCP backend, the integrations) use internal entry
    points that take what they need (an open directory, a create-only flag): no public function
    has a parameter no user may pass."""
    assert [p for p in _private_parameters() if p not in FRAMEWORK_PARAMETERS] == []


def test_the_parameter_check_sees_every_public_face():
    """The check itself can fail: it reads save's parameters, and the exception it allows exists."""
    import inspect

    assert "sign_with" in inspect.signature(ckptfmt.save).parameters
    assert set(FRAMEWORK_PARAMETERS) <= set(_private_parameters())


# -- commands that build no tensor import neither torch nor numpy -----------------------------------

#: ``python -m ckptfmt ARGS`` in a process where ``import torch`` and ``import numpy`` fail
#: (a None in sys.modules makes any import of them raise ImportError)
_WITHOUT_TORCH = """
import runpy, sys
for name in ("torch", "numpy"):
    sys.modules[name] = None
sys.argv = ["ckptfmt", *sys.argv[1:]]
runpy.run_module("ckptfmt", run_name="__main__", alter_sys=True)
"""


def _cli_without_torch(*args: object, rc: int = 0) -> str:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.path.dirname(ROOT)},
    )
    assert proc.returncode == rc, (args, proc.returncode, proc.stdout, proc.stderr[-2000:])
    return proc.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Files and a run written with torch, for the commands to read without it."""
    import torch

    d = tmp_path_factory.mktemp("torchless")
    state = {"w": torch.arange(4096.0).reshape(64, 64), "step": 3, "device": torch.device("cpu")}
    ckptfmt.save(state, d / "plain.ckpt", compression="zstd", chunk_size=1 << 12)
    (d / "key.bin").write_text("ab" * 32)
    ckptfmt.save(state, d / "encrypted.ckpt", encrypt_with=str(d / "key.bin"))
    damaged = bytearray((d / "plain.ckpt").read_bytes())
    with ckptfmt.open(d / "plain.ckpt") as r:
        damaged[r._file.chunks[1].offset + 3] ^= 1
    (d / "damaged.ckpt").write_bytes(bytes(damaged))
    run = ckptfmt.CheckpointManager(d / "run")
    for step in (1, 2):
        run.save(step, {"w": torch.ones(8) * step})
    ckptfmt.CheckpointManager(d / "encrypted-run", encrypt_with=str(d / "key.bin")).save(
        1, {"w": torch.ones(8)}
    )
    ckptfmt.CheckpointManager(d / "damaged-run").save(1, {"w": torch.ones(8)})
    # a state torch's CPU generator refuses ("left" 0): found from the bytes as stored
    forge_state_file(str(d / "damaged-run"), 1, lambda p: p["rng"]["torch_cpu"][8:12].zero_())
    return d


def test_commands_that_build_no_tensor_run_without_torch_or_numpy(saved):
    """verify, ls, inspect, keygen and sign, end to end, where torch and numpy cannot be imported:
    a plain, a damaged, a signed and an encrypted file (with and without its key), a run."""
    d = saved
    assert "plain.ckpt: OK" in _cli_without_torch("verify", d / "plain.ckpt")
    assert "FAILED corrupt: checksum mismatch" in _cli_without_torch("verify", d / "damaged.ckpt", rc=1)
    assert "['w']: tensor float32 [64, 64]" in _cli_without_torch("inspect", d / "plain.ckpt")
    assert "device(type='cpu')" in _cli_without_torch("inspect", d / "plain.ckpt")
    _cli_without_torch("keygen", d / "signer")
    _cli_without_torch("keygen", "--encryption", d / "other.key")
    assert len((d / "other.key").read_text().strip()) == 64
    assert "signed" in _cli_without_torch("sign", d / "plain.ckpt", "--key", d / "signer")
    assert "OK" in _cli_without_torch("verify", d / "plain.ckpt", "--trusted-key", d / "signer.pub")
    assert "FAILED signature" in _cli_without_torch(
        "verify", d / "encrypted.ckpt", "--trusted-key", d / "signer.pub", rc=1
    )
    assert "encrypted.ckpt: OK" in _cli_without_torch(
        "verify", d / "encrypted.ckpt", "--decrypt-key", d / "key.bin"
    )
    assert "checked without its key" in _cli_without_torch("verify", d / "encrypted.ckpt")
    assert "['w']: tensor float32" in _cli_without_torch(
        "inspect", d / "encrypted.ckpt", "--decrypt-key", d / "key.bin"
    )
    assert "signed" in _cli_without_torch(
        "sign", d / "encrypted.ckpt", "--key", d / "signer", "--decrypt-key", d / "key.bin"
    )
    assert "OK" in _cli_without_torch("verify", d / "encrypted.ckpt", "--trusted-key", d / "signer.pub")
    steps = json.loads(_cli_without_torch("ls", "--json", d / "run"))["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [(1, "complete"), (2, "complete")]


def test_verify_of_steps_runs_without_torch_or_numpy(saved):
    """A manager's steps, plain, signed and encrypted, verified where torch and numpy cannot be
    imported, with the checks a resume makes on the state file's entries (a malformed RNG state
    is found from its bytes)."""
    d = saved
    step = d / "run" / "step-000000002"
    assert _cli_without_torch("verify", d / "run").count(": OK") == 2
    assert f"{step}: OK" in _cli_without_torch("verify", step)
    _cli_without_torch("keygen", d / "step-signer")
    assert "signed" in _cli_without_torch("sign", step, "--key", d / "step-signer")
    assert f"{step}: OK" in _cli_without_torch("verify", step, "--trusted-key", d / "step-signer.pub")
    assert "OK" in _cli_without_torch("verify", d / "encrypted-run", "--decrypt-key", d / "key.bin")
    out = _cli_without_torch("verify", d / "damaged-run", rc=1)
    assert "FAILED corrupt" in out and "rng.torch_cpu" in out, out


def _two_rank_run(rank: int, world: int, run_dir: str) -> dict[str, object]:
    """A manager's step saved by 2 ranks (through DCP: a rank file each and a "dcp" record)."""
    import torch

    ckptfmt.CheckpointManager(run_dir).save(1, {"w": torch.arange(16.0), "step": 1})
    return {}


@pytest.fixture(scope="module")
def dcp_saved(tmp_path_factory):
    """DCP directories (plain, signed, encrypted, with damaged records) and a run of 2 ranks,
    written with torch, for the commands to read without it."""
    import torch
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from helpers import run_ranks
    from test_hostile_dcp import rewrite, set_chunks

    from ckptfmt import dcp as cdcp

    d = tmp_path_factory.mktemp("torchless-dcp")
    state = {"m": torch.arange(48.0).reshape(8, 6), "v": torch.ones(10), "lr": 0.5}
    cdcp.save(state, d / "plain")
    (d / "key.bin").write_text("cd" * 32)
    cdcp.save(state, d / "encrypted", encrypt_with=str(d / "key.bin"))
    signer = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    cdcp.save(state, d / "signed", sign_with=signer)
    for name, rows in (
        ("overlap", [[0, 0, 5, 6, 0, 0], [4, 0, 4, 6, 0, 0]]),  # rows 4 held twice, as many elements
        ("gap", [[0, 0, 4, 6, 0, 0], [5, 0, 3, 6, 0, 0]]),  # row 4 held by no chunk
    ):
        cdcp.save(state, d / name)
        rewrite(d / name, lambda v, rows=rows: set_chunks(v, "m", rows))
    assert run_ranks(_two_rank_run, 2, d, str(d / "ranks")) == [{}, {}]
    return d, signer


def test_verify_ls_and_sign_of_dcp_directories_run_without_torch_or_numpy(dcp_saved):
    """A DCP directory (plain, signed, encrypted), signed and verified where torch and numpy
    cannot be imported, with every check a load makes of its record and rank files; a record
    whose shards overlap or leave a gap is corrupt; a run of 2 ranks lists and verifies."""
    d, signer = dcp_saved
    from cryptography.hazmat.primitives import serialization

    assert f"{d / 'plain'}: OK" in _cli_without_torch("verify", d / "plain")
    info = json.loads(_cli_without_torch("ls", "--json", d / "plain"))
    assert (info["complete"], info["tensors"], info["values"], info["world_size"]) == (True, 2, 1, 1)
    pub = signer.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (d / "signer.pub").write_bytes(pub)
    assert "OK" in _cli_without_torch("verify", d / "signed", "--trusted-key", d / "signer.pub")
    assert "FAILED signature" in _cli_without_torch(
        "verify", d / "plain", "--trusted-key", d / "signer.pub", rc=1
    )
    assert "OK" in _cli_without_torch("verify", d / "encrypted", "--decrypt-key", d / "key.bin")
    _cli_without_torch("keygen", d / "dir-signer")
    assert "signed" in _cli_without_torch("sign", d / "plain", "--key", d / "dir-signer")
    assert "OK" in _cli_without_torch("verify", d / "plain", "--trusted-key", d / "dir-signer.pub")
    assert "signed" in _cli_without_torch(
        "sign", d / "encrypted", "--key", d / "dir-signer", "--decrypt-key", d / "key.bin"
    )
    out = _cli_without_torch(
        "verify", d / "encrypted", "--trusted-key", d / "dir-signer.pub", "--decrypt-key", d / "key.bin"
    )
    assert "OK" in out, out
    for name, why in (("overlap", "overlap"), ("gap", "the chunks hold 42 elements, the tensor has 48")):
        out = _cli_without_torch("verify", d / name, rc=1)
        assert "FAILED corrupt" in out and why in out, out
    steps = json.loads(_cli_without_torch("ls", "--json", d / "ranks"))["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [(1, "complete")]
    assert _cli_without_torch("verify", d / "ranks").count(": OK") == 1


def test_a_dcp_record_signed_without_numpy_keeps_its_arrays_and_loads(dcp_saved):
    """The record ``sign`` wrote where numpy cannot be imported holds the same arrays, byte
    for byte (a record read twice compares equal), and loads, trusted, into the saved state."""
    import torch

    from ckptfmt import dcp as cdcp
    from ckptfmt.files import multifile

    d, _ = dcp_saved
    saved = {"m": torch.arange(48.0).reshape(8, 6), "v": torch.ones(10), "lr": 0.5}
    cdcp.save(saved, d / "to-sign")
    before = multifile.read_commit(str(d / "to-sign"))
    assert before == multifile.read_commit(str(d / "to-sign"))
    _cli_without_torch("keygen", d / "load-signer")
    assert "signed" in _cli_without_torch("sign", d / "to-sign", "--key", d / "load-signer")
    after = multifile.read_commit(str(d / "to-sign"))
    assert after.layout_data == before.layout_data and after.files[0].sha256 is not None
    back = {"m": torch.zeros(8, 6), "v": torch.zeros(10), "lr": 0.0}
    cdcp.load(back, d / "to-sign", trusted_keys=str(d / "load-signer.pub"))
    assert torch.equal(back["m"], saved["m"]) and torch.equal(back["v"], saved["v"]) and back["lr"] == 0.5


def test_the_shim_stops_torch():
    """The check itself can fail: a command that builds tensors (info reports torch's version)
    cannot run where torch cannot be imported."""
    assert "ModuleNotFoundError" not in _cli_without_torch("--version")
    with pytest.raises(AssertionError, match="import of (torch|numpy) halted"):
        _cli_without_torch("info")
