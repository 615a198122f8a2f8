"""The layers of Utils/, kept by reading every module's imports (nothing is imported or run).

Data flows one way: rung script -> ladder -> train (model, data, kernels) -> results -> report; a peer (another
trainer, Utils.peers) runs through train or beside it and records through results. Each layer
may import the layers its row names, and nothing above it; results and report import no torch, so that
`make plots` works where torch cannot be imported, and so does the model's configuration (model_config),
which report reads; the model knows no kernel; no import cycle.
"""
import ast
import os

import pytest

from conftest import REPO_ROOT

UTILS = os.path.join(REPO_ROOT, "Utils")
# Layer -> the Utils layers it may import (itself included). ladder.registry is data only (no imports), so
# report may read the rung order from it.
# model_config is the model's configuration as plain data, so report may read the model's sizes from it.
ALLOWED = {
    "kernels": {"kernels"},
    "model_config": {"model_config"},
    "model": {"model", "model_config"},
    "ladder": {"ladder", "model", "model_config", "kernels"},
    "train": {"train", "ladder", "model", "model_config", "results"},
    "peers": {"peers", "train", "ladder", "model", "model_config", "results"},
    "results": {"results"},
    "report": {"report", "results", "ladder.registry", "model_config"},
    "install": {"install"},   # runs before anything is installed: the standard library only
    "peak": {"peak", "train", "results"},   # this machine's matmul and copy peaks: MFU's second denominator
    # the driver make calls: it starts every run as a process and reads only the registry, the peers' names, the
    # usage errors and what a results path can be (results imports no torch), so that it holds no CUDA context
    # while a rung measures
    "suite": {"suite", "ladder", "peers", "train", "results"},
}
NO_TORCH = ("results", "report", "model_config", "install", "suite")
TORCH = ("torch", "triton", "numpy.testing")


def _modules():
    """{dotted module name: path} for every Python module under Utils/."""
    found = {}
    for root, _, files in os.walk(UTILS):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(path):
    """Every module name the file imports, at any depth of the file (function-level imports count too)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            # `from Utils.kernels import loss_kernel` imports the module Utils.kernels.loss_kernel
            names.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
    return names


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _layer(module):
    """'kernels', 'ladder.registry', ... for a Utils module; None for Utils itself."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if parts[:2] == ["ladder", "registry"]:
        return "ladder.registry"
    return parts[0]


def _utils_imports(module):
    return {m for m in IMPORTS[module] if m.startswith("Utils.") and m in MODULES}


def test_every_module_belongs_to_a_layer():
    layers = {_layer(m) for m in MODULES} - {None}
    assert layers <= set(ALLOWED) | {"ladder.registry"}, layers - set(ALLOWED)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m)))
def test_a_module_imports_only_the_layers_below_it(module):
    layer = _layer(module)
    allowed = set() if layer == "ladder.registry" else ALLOWED[layer]   # the registry imports nothing of Utils

    def ok(target):
        other = _layer(target)
        return other == layer or other in allowed or (other == "ladder.registry" and "ladder" in allowed)

    wrong = sorted(m for m in _utils_imports(module) if not ok(m))
    assert not wrong, f"{module} ({layer}) imports {wrong}"


def _reach(module, seen=None):
    seen = set() if seen is None else seen
    for m in _utils_imports(module):
        if m not in seen:
            seen.add(m)
            _reach(m, seen)
    return seen


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) in NO_TORCH))
def test_results_and_report_import_no_torch_even_through_other_modules(module):
    for m in {module} | _reach(module):
        heavy = sorted(i for i in IMPORTS[m] if i.split(".")[0] in TORCH or i in TORCH)
        assert not heavy, f"{module} reaches {m}, which imports {heavy}"


def test_the_model_imports_no_kernel():
    assert not any(m.startswith("Utils.kernels") for m in _reach("Utils.model"))


def test_no_import_cycle():
    for module in MODULES:
        assert module not in _reach(module), f"{module} imports itself through {sorted(_reach(module))}"


def test_the_checks_see_real_imports():
    # The rules above are only as good as the import graph they read: it must hold the edges we know.
    assert "Utils.kernels.loss_kernel" in _utils_imports("Utils.kernels.chunked_loss")
    assert "Utils.kernels.native" in _utils_imports("Utils.kernels.loss_kernel")
    assert "Utils.kernels.gemm_bias_grad" in _utils_imports("Utils.ladder.linear")
    assert "Utils.ladder.registry" in _reach("Utils.train.run")
    assert any(i.startswith("torch") for i in IMPORTS["Utils.model"])
