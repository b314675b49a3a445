"""The package's layout says which process runs a line: each subpackage imports only what its process may.

Every ``import`` of an nbfsdp module anywhere in a file counts (at the top, inside functions, under
``TYPE_CHECKING``), read from the source with ``ast``: nothing is imported to check it.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nbfsdp"

#: What each subpackage may import of nbfsdp ("nbfsdp" alone: the package root, whose names load lazily).
ALLOWED = {
    "shared": {"shared"},
    "engines": {"engines", "shared", "nbfsdp"},
    "helpers": {"helpers", "shared"},
    "ui": {"ui", "helpers", "shared"},
    "kernel": {"kernel", "ui", "engines", "helpers", "shared"},
    "course": {"course", "shared"},
}
#: Third-party modules of the kernel's side that code shared with the ranks must not import.
KERNEL_ONLY = ("IPython", "ipykernel", "ipywidgets", "ipyparallel.client", "ipyparallel.cluster", "jupyter_ui_poll")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: nbfsdp uses absolute imports only"
            base = node.module or ""
            # ``from nbfsdp.kernel.run import session`` imports nbfsdp.kernel.run.session
            found += [(node.lineno, f"{base}.{alias.name}" if base in _packages() else base) for alias in node.names]
    return sorted(found)


def _packages() -> set[str]:
    return {"nbfsdp", *(".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py"))}


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and f"nbfsdp.{parts[1]}" in _packages() else "nbfsdp"


def _violations(subpackage: str) -> list[str]:
    wrong = []
    for path in sorted((PACKAGE / subpackage).rglob("*.py")):
        for line, module in _imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if module == "nbfsdp" or module.startswith("nbfsdp."):
                if _subpackage(module) not in ALLOWED[subpackage]:
                    wrong.append(f"{where} imports {module}")
            elif subpackage in ("shared", "engines", "helpers", "course") and module.startswith(KERNEL_ONLY):
                wrong.append(f"{where} imports {module}, the kernel's side")
    return wrong


def test_every_module_is_in_a_subpackage_that_says_what_it_may_import():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py"]
    for subpackage in ALLOWED:
        assert (PACKAGE / subpackage / "__init__.py").read_text().strip(), f"{subpackage} has no docstring"
    assert set(ALLOWED) == {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_imports_go_only_where_the_process_allows(subpackage):
    assert _violations(subpackage) == []


def test_the_check_sees_an_import_from_the_wrong_side(tmp_path, monkeypatch):
    """The check itself: an engine module importing the kernel's cluster, even inside a function, is caught."""
    fake = tmp_path / "nbfsdp"
    (fake / "engines").mkdir(parents=True)
    (fake / "kernel").mkdir()
    for sub in ("engines", "kernel"):
        (fake / sub / "__init__.py").write_text('"""x"""\n')
    (fake / "engines" / "bad.py").write_text(
        "def f():\n    from nbfsdp.kernel import cluster\n\nfrom IPython.core.error import UsageError\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _violations("engines") == [
        "nbfsdp/engines/bad.py:2 imports nbfsdp.kernel.cluster",
        "nbfsdp/engines/bad.py:4 imports IPython.core.error, the kernel's side",
    ]


def test_importing_the_package_loads_no_torch_ipyparallel_or_widgets():
    """``import nbfsdp`` stays light: the public names load on first use."""
    heavy = ("torch", "ipyparallel", "ipywidgets", "IPython")
    code = f"import sys, nbfsdp; print(sorted(m for m in {heavy} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_load_ext_reads_its_prewarm_setting_without_torch():
    """``%load_ext nbfsdp`` returns at once and torch loads behind it, in the background start's thread: what
    the kernel's thread runs first (the world size to start, from the cluster's limits) must not import it."""
    code = "import sys, nbfsdp; print(nbfsdp.prewarm_world_size(), 'torch' in sys.modules)"
    env = {**os.environ, "NBFSDP_PREWARM": "2"}
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert loaded.split() == ["2", "False"]


def test_the_benchmarks_import_nothing_of_the_tests():
    """The tests import the benchmarks they test (and the namespace hosts both use); never the other way."""
    benchmarks = PACKAGE.parent / "benchmarks"
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in sorted(benchmarks.rglob("*.py"))
        for line, module in _imports(path)
        if module == "tests" or module.startswith("tests.")
    ]
    assert not wrong, wrong


def test_the_package_root_keeps_only_the_public_names():
    """The extension's loader lives in ``kernel/extension.py``; the root is the lazy public names."""
    root = (PACKAGE / "__init__.py").read_text()
    assert len(root.splitlines()) < 100 and "class " not in root and "threading" not in root


def _runtime_imports(path: Path) -> set[str]:
    """The nbfsdp modules ``path`` imports when it runs, at its top or inside functions; those under ``if
    TYPE_CHECKING:`` are for the type checker only."""
    found, modules = set(), _modules()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {module for module in found if module in modules and module != "nbfsdp"}


def _modules() -> dict[str, Path]:
    named = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        named[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return named


def test_no_module_imports_one_that_imports_it_back():
    """No cycle among nbfsdp's modules, lazy imports included (so none between subpackages either): a module
    can be read, tested and moved knowing only what it imports."""
    graph = {module: _runtime_imports(path) - {module} for module, path in _modules().items()}
    cycles, done = [], set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module) :] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph[module]):
            walk(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        walk(module, [])
    assert not cycles, cycles


def _package_of(module: str) -> str:
    """The (sub)package a module sits in: ``nbfsdp.kernel.run`` for ``nbfsdp.kernel.run.session``."""
    return module if (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists() else module.rpartition(".")[0]


def test_no_package_imports_one_that_imports_it_back():
    """Packages form no cycle either, the kernel's own (cluster, run, planning, checkpoints) included: a
    package's path says what it is for, and what it may lean on."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = _package_of(module)
        graph.setdefault(package, set()).update(_package_of(m) for m in _runtime_imports(path))
    for package, imported in graph.items():
        # a package's parent only holds it (``nbfsdp`` loads its names lazily): no edge upwards
        imported.difference_update({package, *(p for p in imported if package.startswith(p + "."))})
    cycles = []

    def walk(package: str, path: list[str]) -> None:
        if package in path:
            cycles.append(path[path.index(package) :] + [package])
            return
        for imported in sorted(graph.get(package, ())):
            if len(path) < len(graph):
                walk(imported, [*path, package])

    for package in sorted(graph):
        walk(package, [])
    assert not cycles, cycles[:3]


def test_no_class_is_over_300_lines():
    """A class a reader can hold in their head: one job each (the session's cell run, what the engines
    hold, the calls on every rank are each a module of their own)."""
    sizes = {
        f"{path.relative_to(PACKAGE.parent)}:{node.name}": node.end_lineno - node.lineno + 1
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert sizes and {name: lines for name, lines in sizes.items() if lines > 300} == {}


def test_no_module_on_the_ranks_is_over_450_lines():
    """The ranks' checkpoint code is split by job (what a checkpoint holds, saves, loads, loader positions,
    interval saves): no module there does six things."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "engines").glob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > 450} == {}


def _long_positional(path: Path) -> list[str]:
    """Functions of ``path`` that take more than 6 positional parameters (``self`` and ``cls`` not counted), but
    those whose ``def`` line says why (``# noqa: PLR0917 (...)``: a signature that mirrors another library's)."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in [*node.args.posonlyargs, *node.args.args] if a.arg not in ("self", "cls")]
            if len(names) > 6 and not re.search(r"noqa: [A-Z0-9, ]*PLR0917", lines[node.lineno - 1]):
                found.append(f"{node.lineno}: {node.name} ({len(names)})")
    return found


def test_no_function_takes_more_than_6_positional_parameters():
    """What follows the first few is keyword-only, so a call reads as what it passes (ruff's ``PLR0917``, held
    here: in ruff it is a preview rule)."""
    long = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if (found := _long_positional(path))
    }
    assert long == {}


def test_the_positional_check_counts_what_a_caller_can_pass_by_position(tmp_path):
    source = tmp_path / "calls.py"
    source.write_text(
        "def f(a, b, c, d, e, f, g): pass\n"
        "def g(a, b, c, d, e, f, *, g): pass\n"
        "class C:\n    def m(self, a, b, c, d, e, f): pass\n    def n(self, a, b, c, d, e, f, g, /): pass\n"
        "def h(a, b, c, d, e, f, g):  # noqa: PLR0913, PLR0917 (mirrors torch)\n    pass\n"
    )
    assert _long_positional(source) == ["1: f (7)", "5: n (7)"]


def test_the_formatter_is_left_to_format():
    """``# fmt: skip`` only where a table reads better aligned by hand (the collectives, the GPUs' capabilities,
    the live settings): fewer than 10 in the package."""
    skips = {
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt: skip")
    }
    assert len(skips) < 10, sorted(skips)


#: What each of the kernel's packages may import of the kernel (docs/design.md draws the same table).
KERNEL_ALLOWED = {
    "cluster": {"cluster"},
    "planning": {"planning", "cluster"},
    "diagnostics": {"diagnostics", "cluster", "planning"},
    "run": {"run", "cluster", "planning", "diagnostics"},
    "checkpoints": {"checkpoints", "cluster", "planning", "diagnostics", "run"},
}


def test_the_kernels_packages_lean_only_on_those_below_them():
    kernel = PACKAGE / "kernel"
    assert {p.name for p in kernel.iterdir() if (p / "__init__.py").exists()} == set(KERNEL_ALLOWED)
    wrong = []
    for package, allowed in KERNEL_ALLOWED.items():
        for path in sorted((kernel / package).rglob("*.py")):
            for module in _runtime_imports(path):
                parts = module.split(".")
                if parts[:2] == ["nbfsdp", "kernel"] and len(parts) > 3 and parts[2] not in allowed:
                    wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert wrong == []


#: The modules that may use torch's private names (docs/design.md, CONTRIBUTING.md): each function there is
#: tested directly (tests/test_torch_private.py), so a torch release that breaks one fails by name.
TORCH_FENCE = {"nbfsdp/shared/torch_private.py", "nbfsdp/kernel/planning/torch_private.py"}


def _private(dotted: str) -> bool:
    """A torch name with a private segment: ``torch.utils._pytree``, ``torch._C``, ``torch.ops.aten._x``."""
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def _torch_names(tree: ast.Module) -> tuple[dict[str, str], Callable[[ast.AST], str | None]]:
    """The names a module binds to torch's modules and objects by import (``import torch.nn as nn``), and what a
    name or attribute chain is in torch's terms (``nn.Module.x`` -> ``torch.nn.Module.x``; None: not torch's)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            bound.update((alias.asname or alias.name, f"{node.module}.{alias.name}") for alias in node.names)

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    return bound, dotted


def _private_torch_names(path: Path) -> list[str]:
    """``line: name`` of each private torch name ``path`` imports or reaches by attribute, through the names it
    binds to torch's modules and objects (``import torch.nn as nn``, ``aten = torch.ops.aten``)."""
    tree = ast.parse(path.read_text(), str(path))
    bound, dotted = _torch_names(tree)
    for node in ast.walk(tree):  # names bound to a torch object: ``aten = torch.ops.aten``
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = dotted(node.value)
            if value is not None and value.startswith("torch"):
                bound[node.targets[0].id] = value
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, dotted(node) or ""))
    private = {(line, name) for line, name in found if _private(name)}
    # ``torch._C._autograd.x`` once, not each prefix of it
    longest = {
        (line, name) for line, name in private if not any(o[0] == line and o[1].startswith(name + ".") for o in private)
    }
    return [f"{line}: {name}" for line, name in sorted(longest)]


def test_private_torch_names_are_used_only_behind_the_fence():
    """No module but the fenced ones imports, calls or reads a private torch name (``torch.*._x``, ``aten._x``):
    what a torch release may move without notice is held in one place, by a test."""
    wrong = {
        str(path.relative_to(PACKAGE.parent)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE.parent)) not in TORCH_FENCE and (names := _private_torch_names(path))
    }
    assert wrong == {}


def test_the_fence_check_sees_each_way_of_reaching_a_private_name(tmp_path):
    """The check itself: imports of private modules and names, attributes through any alias, ``aten._x``."""
    source = tmp_path / "reaching.py"
    source.write_text(
        "import torch\nimport torch.nn as nn\nfrom torch.utils._pytree import tree_map\n"
        "from torch.utils.data.dataloader import _InfiniteConstantSampler\n"
        "aten = torch.ops.aten\n"
        "def f(x):\n    torch._C._autograd.x\n    aten._scaled_dot_product_attention_math(x)\n"
        "    nn.Module._apply\n    return torch.__version__, torch.nn.functional.relu(x), x._private\n"
    )
    assert _private_torch_names(source) == [
        "3: torch.utils._pytree.tree_map",
        "4: torch.utils.data.dataloader._InfiniteConstantSampler",
        "7: torch._C._autograd.x",
        "8: torch.ops.aten._scaled_dot_product_attention_math",
        "9: torch.nn.Module._apply",
    ]


def test_the_planners_model_of_fsdp2_is_in_parts():
    """The traced step (``planning/peak.py``, the ledger of FSDP2's allocations) apart from its dispatch counter,
    attention, autocast and batch, each a module; ``plans._plan`` in units, memory and communication."""
    planning = PACKAGE / "kernel" / "planning"
    assert len((planning / "peak.py").read_text().splitlines()) < 500
    functions = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse((planning / "plans.py").read_text()))
        if isinstance(node, ast.FunctionDef)
    }
    assert {"_units", "_memory", "_communication"} <= set(functions) and functions["_plan"] <= 50


def test_the_ranks_cell_is_named_steps_and_no_function_on_the_ranks_is_long():
    """The rank's side of a cell as the kernel's is: enter, execute, its results in a module of their own
    (``engines/cell_results.py``); no function in ``engines/`` over 50 lines (``_run_cell`` was 134)."""
    engines = PACKAGE / "engines"
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(engines.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 50
    ]
    assert not long, long
    engine = {node.name for node in ast.parse((engines / "engine.py").read_text()).body if hasattr(node, "name")}
    assert {"_enter", "_execute", "_run_cell"} <= engine
    results = ast.parse((engines / "cell_results.py").read_text()).body
    assert "outcome" in {node.name for node in results if hasattr(node, "name")}


#: Underscored attributes that are contracts, not internals: Python's documented ``os._exit`` and
#: ``sys._current_frames``, and Composer's per-module flags a user sets (``_fsdp_wrap``, ``_activation_checkpointing``).
#: nbfsdp's own marks on others' objects begin ``_nbfsdp``.
DOCUMENTED_PRIVATE = {"_exit", "_current_frames", "_fsdp_wrap", "_activation_checkpointing"}


def _own_attributes() -> set[str]:
    """The underscored names nbfsdp makes itself, outside its fences: its functions and classes, its modules' and
    classes' assignments, and what its methods set on ``self``."""
    own: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith("_private.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _receiver(node) == "self":
                own.add(node.attr)
        for scope in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]:
            for node in scope.body:
                if isinstance(node, ast.Assign):
                    own |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    own.add(node.target.id)
    return own


def _receiver(node: ast.Attribute) -> str | None:
    return node.value.id if isinstance(node.value, ast.Name) else None


def _others_private_attributes(path: Path, own: set[str]) -> list[str]:
    """``line: name`` of each underscored attribute ``path`` reaches that nbfsdp does not make: another library's
    internals (``module._parameters``, ``tensor._version``, ``model_class._from_config``), whatever the receiver."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if _receiver(node) in ("self", "cls", "nbfsdp") or node.attr.startswith("_nbfsdp"):
            continue
        if node.attr not in own and node.attr not in DOCUMENTED_PRIVATE:
            found.append(f"{node.lineno}: {node.attr}")
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def _torch_attribute_assignments(path: Path) -> list[str]:
    """``line: name`` of each assignment to an attribute of a torch module or class (``torch.Tensor.backward =``,
    ``nn.Module.register_parameter =``, ``setattr(torch.amp.GradScaler, ...)``): a patch of torch."""
    tree = ast.parse(path.read_text(), str(path))
    _, dotted = _torch_names(tree)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [dotted(t) for t in targets if isinstance(t, ast.Attribute)]
            found += [f"{node.lineno}: {name}" for name in names if name and name.startswith("torch.")]
        is_setattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
        owner = dotted(node.args[0]) if is_setattr and node.args else None
        if owner is not None and owner.startswith("torch"):
            found.append(f"{node.lineno}: setattr({owner}, ...)")
    return found


def test_other_libraries_internals_and_patches_of_torch_are_reached_only_behind_a_fence():
    """Outside the ``*_private.py`` modules, no underscored attribute of another library's (on any receiver: the
    check cannot know the receiver's type, so it asks whether nbfsdp makes the name), and no assignment to a
    torch module's or class's attribute: each is a named helper in a fence, tested directly."""
    own = _own_attributes()
    outside = [path for path in sorted(PACKAGE.rglob("*.py")) if not path.name.endswith("_private.py")]
    wrong = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in outside
        if (found := _others_private_attributes(path, own) + _torch_attribute_assignments(path))
    }
    assert wrong == {}


def test_the_internals_check_sees_a_reach_on_any_receiver_and_a_patch(tmp_path):
    source = tmp_path / "reaching.py"
    source.write_text(
        "import torch\nimport torch.nn as nn\nimport os\n"
        "def f(module, tensor, marked):\n"
        "    module._parameters['w'] = None\n    n = tensor._version\n    os._exit(0)\n"
        "    marked._nbfsdp_seen = True\n    return module._fsdp_wrap, n\n"
        "torch.Tensor.backward = f\nnn.Module.register_parameter = f\nsetattr(torch.amp.GradScaler, 'scale', f)\n"
    )
    assert _others_private_attributes(source, own=set()) == ["5: _parameters", "6: _version"]
    assert _torch_attribute_assignments(source) == [
        "10: torch.Tensor.backward",
        "11: torch.nn.Module.register_parameter",
        "12: setattr(torch.amp.GradScaler, ...)",
    ]
