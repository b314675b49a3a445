"""What the documentation says of the code is what the code is: ``docs/design.md``'s module map names every
module, and every dotted nbfsdp name a docstring gives in double backticks exists.

Read from the source with ``ast``, nothing imported. A dotted name is checked where its first part is
``nbfsdp``, the name of one of nbfsdp's modules or of one of its classes, and not a parameter of the function
it documents nor a name its module imports from another library (``kernel.shell_channel_thread`` in a
function given ipykernel's ``kernel``); file names (``config.json``) are not names.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "nbfsdp"
REFERENCE = re.compile(r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``")
FILE_SUFFIXES = {"py", "json", "md", "pt", "safetensors", "txt", "bin", "yaml", "toml"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, packages by their ``__init__``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _members(node: ast.ClassDef) -> set[str]:
    """A class's names: its methods, class attributes, fields, and what its methods assign to ``self``."""
    names = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(inner.name)
        elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
            names.add(inner.target.id)
        elif isinstance(inner, ast.Assign):
            names |= {t.id for t in inner.targets if isinstance(t, ast.Name)}
        elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store) and _on_self(inner):
            names.add(inner.attr)
    return names


def _on_self(attribute: ast.Attribute) -> bool:
    return isinstance(attribute.value, ast.Name) and attribute.value.id == "self"


def _top_level(tree: ast.Module) -> dict[str, set[str] | None]:
    """A module's names; a class's maps to its members (None: a function, a value or an import)."""
    names: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = _members(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign):
            names.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
    return names


def _imported_from_elsewhere(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("nbfsdp"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("nbfsdp")}
    return names


class Names:
    """nbfsdp's modules, classes and public names, to resolve a dotted reference against."""

    def __init__(self) -> None:
        self.trees = {name: ast.parse(path.read_text()) for name, path in _modules().items()}
        self.top = {name: _top_level(tree) for name, tree in self.trees.items()}
        self.by_basename: dict[str, list[str]] = {}
        self.classes: dict[str, list[set[str]]] = {}
        for module, names in self.top.items():
            self.by_basename.setdefault(module.rsplit(".", 1)[-1], []).append(module)
            for name, members in names.items():
                if members is not None:
                    self.classes.setdefault(name, []).append(members)
        init = self.trees["nbfsdp"]
        assigned = next(n for n in init.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__")
        self.public = set(ast.literal_eval(assigned.value))

    def resolves(self, reference: str) -> bool | None:
        """Whether ``reference`` names something of nbfsdp's; None where it is not nbfsdp's to say."""
        parts = reference.split(".")
        if parts[-1] in FILE_SUFFIXES:
            return None
        if parts[0] == "nbfsdp":
            if len(parts) == 2 and parts[1] in self.public:
                return True
            for cut in range(len(parts), 0, -1):
                if ".".join(parts[:cut]) in self.top:
                    return self._has(self.top[".".join(parts[:cut])], parts[cut:])
            return False
        if parts[0] in self.by_basename:
            modules = self.by_basename[parts[0]]
            return any(self._has(self.top[m], parts[1:]) or f"{m}.{parts[1]}" in self.top for m in modules)
        if parts[0] in self.classes:
            return any(parts[1] in members for members in self.classes[parts[0]])
        return None

    @staticmethod
    def _has(names: dict[str, set[str] | None], rest: list[str]) -> bool:
        if not rest:
            return True
        if rest[0] not in names:
            return False
        members = names[rest[0]]
        return len(rest) == 1 or members is None or rest[1] in members  # past a value: not followed


def test_the_design_documents_module_map_names_every_module():
    design = (REPO / "docs" / "design.md").read_text()
    named = set(re.findall(r"`([\w/]+\.py)`", design))
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py" and str(path.relative_to(PACKAGE)) not in named
    ]
    assert not missing, f"docs/design.md's layout lacks {missing}"


def test_every_dotted_nbfsdp_name_in_a_docstring_exists():
    names = Names()
    stale = []
    for module, tree in names.trees.items():
        outside = _imported_from_elsewhere(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            functions = (ast.FunctionDef, ast.AsyncFunctionDef)
            parameters = (
                {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)} if isinstance(node, functions) else set()
            )
            for reference in REFERENCE.findall(ast.get_docstring(node) or ""):
                if reference.split(".")[0] in parameters | outside:
                    continue
                if names.resolves(reference) is False:
                    stale.append(f"{module}:{getattr(node, 'lineno', 1)} ``{reference}``")
    assert not stale, stale


def test_the_reference_check_sees_a_name_that_is_gone():
    names = Names()
    assert names.resolves("nbfsdp.kernel.run.session.Session.run_cell")
    assert names.resolves("session.Session.run_cell") and names.resolves("Session.run_cell")
    assert names.resolves("nbfsdp.last_run") and names.resolves("torch_private.set_unshard_async_op")
    assert names.resolves("Session._send_models") is False  # renamed away: the stale name this test was for
    assert names.resolves("engine._writes") is False and names.resolves("planning.plan") is False
    assert names.resolves("torch.distributed.all_gather") is None and names.resolves("config.json") is None
