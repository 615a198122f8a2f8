"""Utils/kernels stays shallow: a module that imports no other kernel module is floor 0, any other is 1 + the
highest floor among those it imports, and none may be above floor 2. Nothing there imports the rest of Utils.
Read from every module's imports (ast); nothing is imported or run."""
import ast
import os

import pytest

from conftest import REPO_ROOT

KERNELS = os.path.join(REPO_ROOT, "Utils", "kernels")
PACKAGE = "Utils.kernels"
HIGHEST_FLOOR = 2


def _modules() -> dict[str, str]:
    """{module name within Utils.kernels: path}, the package's __init__ left out (it imports nothing)."""
    return {name[:-3]: os.path.join(KERNELS, name) for name in sorted(os.listdir(KERNELS))
            if name.endswith(".py") and name != "__init__.py"}


MODULES = _modules()


def _imported(path: str) -> set[str]:
    """Every dotted name the file imports, at any depth (function-level imports count too); a `from X import y`
    counts as X.y too, since y may be a module."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:   # relative: from the package Utils.kernels
                module = ".".join(filter(None, [PACKAGE, module]))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


IMPORTS = {name: _imported(path) for name, path in MODULES.items()}


def _kernel_imports(module: str) -> set[str]:
    """The kernel modules that `module` imports."""
    return {n.split(".")[2] for n in IMPORTS[module]
            if n.startswith(PACKAGE + ".") and n.split(".")[2] in MODULES and n.split(".")[2] != module}


def floor(module: str, seen: tuple[str, ...] = ()) -> int:
    assert module not in seen, f"import cycle: {' -> '.join(seen + (module,))}"
    below = _kernel_imports(module)
    return 1 + max(floor(m, seen + (module,)) for m in below) if below else 0


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_kernel_module_imports_at_most_two_floors_of_kernel_modules(module):
    assert floor(module) <= HIGHEST_FLOOR, {m: floor(m) for m in sorted(MODULES)}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_kernel_module_imports_nothing_of_utils_outside_the_kernels(module):
    outside = sorted(n for n in IMPORTS[module]
                     if (n == "Utils" or n.startswith("Utils.")) and not (n == PACKAGE or n.startswith(PACKAGE + ".")))
    assert not outside, f"Utils.kernels.{module} imports {outside}"


def test_the_floors_read_real_imports():
    # The checks above are only as good as the import graph they read: it must hold the edges we know.
    assert _kernel_imports("chunked_loss") == {"loss_kernel"}
    assert "native" in _kernel_imports("cublaslt")
    assert floor("native") == 0 and floor("loss_kernel") == 1 and floor("chunked_loss") == 2
    assert max(floor(m) for m in MODULES) == HIGHEST_FLOOR
