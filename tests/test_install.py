"""The locks: fresh against their requirements files, installable with --require-hashes, CUDA-free where the
CPU build of torch is meant, and the plan make install follows on each kind of machine."""
import os
import re
import shutil

import pytest

from Utils import install
from Utils.install import CUDA_ONLY, LOCKS, InstallError, plan, stale

ROOT = install.ROOT


def test_every_lock_is_as_new_as_its_requirements_files():
    assert stale() == [], "\n".join(stale())


@pytest.fixture
def tree(tmp_path):
    """A copy of the requirements files and the locks, to change."""
    for name in os.listdir(ROOT):
        if name.startswith("requirements") and (name.endswith(".txt") or name.endswith(".lock")):
            shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    return tmp_path


def _edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_a_changed_bound_or_an_added_package_makes_the_locks_stale_naming_make_lock(tree):
    _edit(tree / "requirements.txt", "bitsandbytes>=0.45", "bitsandbytes>=0.46")
    problems = stale(str(tree))
    assert len(problems) == 3 and all("run make lock" in p for p in problems)   # every lock of requirements.txt
    assert {p.split()[0] for p in problems} == {"requirements.lock", "requirements-cpu.lock", "requirements-test.lock"}
    _edit(tree / "requirements.txt", "bitsandbytes>=0.46", "bitsandbytes>=0.45")
    assert stale(str(tree)) == []
    with open(tree / "requirements-notebook.txt", "a") as f:   # reached through requirements-test.txt's -r
        f.write("jupyterlab\n")
    assert {p.split()[0] for p in stale(str(tree))} == {"requirements-test.lock", "requirements-notebook.lock"}


def test_a_comment_or_blank_line_leaves_the_locks_fresh(tree):
    with open(tree / "requirements.txt", "a") as f:
        f.write("\n# why a package is here\n")
    assert stale(str(tree)) == []


def test_a_missing_lock_is_named(tree):
    os.remove(tree / "requirements-cpu.lock")
    assert stale(str(tree)) == ["requirements-cpu.lock is missing: run make lock"]


def _entries(lock):
    with open(os.path.join(ROOT, lock.path)) as f:
        return install._entries(f.read())


@pytest.mark.parametrize("key", list(LOCKS))
def test_every_locked_package_has_an_exact_version_and_hashes(key):
    entries = _entries(LOCKS[key])
    assert entries
    for name, text in entries:
        assert re.match(rf"^{re.escape(name)}==[\w.+!-]+( ;|\s*\\)", text, re.I), text.splitlines()[0]
        assert "--hash=sha256:" in text, name


@pytest.mark.parametrize("key", ["cpu", "test"])
def test_the_cpu_locks_leave_out_torch_and_the_cuda_libraries(key):
    names = {n for n, _ in _entries(LOCKS[key])}
    assert "torch" not in names
    cuda = {n for n in names if CUDA_ONLY.match(n)}
    allowed = {"nvidia-ml-py"} | (install.names("requirements-test.txt") if key == "test" else set())
    assert cuda <= allowed, cuda - allowed
    assert "nvidia-cublas" not in names and "nvidia-cudnn-cu13" not in names


def test_the_cuda_lock_pins_torch_as_it_was_measured():
    torch_lines = [t for n, t in _entries(LOCKS["cuda"]) if n == "torch"]
    assert len(torch_lines) == 1 and torch_lines[0].startswith(f"torch=={install.TORCH['cuda']}")


def test_the_cpu_lock_names_its_torch():
    assert install.locked_torch() == install.TORCH["cpu"]


def _commands(steps):
    return [how for _, how in steps if isinstance(how, list)]


def test_a_cpu_machine_keeps_the_locked_torch_and_installs_the_cpu_lock():
    steps = plan("suite", gpu=False, upgrade=False, torch=f"{install.TORCH['cpu']}+cpu", python="py")
    assert _commands(steps) == [] and steps[0][0].endswith("kept")
    assert steps[-1][0] == "requirements-cpu.lock" and "bitsandbytes==" in steps[-1][1]


def test_a_cpu_machine_with_another_torch_gets_the_locked_one_from_the_cpu_index():
    steps = plan("suite", gpu=False, upgrade=False, torch="2.9.1", python="py", cpu_index="https://mirror/cpu")
    assert _commands(steps) == [["py", "-m", "pip", "install", f"torch=={install.TORCH['cpu']}",
                                 "--index-url", "https://mirror/cpu"]]
    assert "in place of 2.9.1" in steps[0][0]


def test_a_gpu_machine_installs_the_cuda_lock_with_torch_in_it():
    steps = plan("suite", gpu=True, upgrade=False, torch=None, python="py")
    assert [what for what, _ in steps] == ["requirements.lock"]
    assert f"torch=={install.TORCH['cuda']}" in steps[0][1]


def test_the_tests_beside_a_cuda_torch_keep_its_triton_and_cuda_libraries():
    steps = plan("test", gpu=True, upgrade=False, torch="2.11.0+cu130", python="py")
    names = {n for n, _ in install._entries(steps[-1][1])}
    assert "pytest" in names and not {n for n in names if CUDA_ONLY.match(n)} - {"nvidia-ml-py"}
    on_cpu = plan("test", gpu=False, upgrade=False, torch="2.13.0+cpu", python="py")
    assert "triton" in {n for n, _ in install._entries(on_cpu[-1][1])}


def test_upgrade_on_a_cpu_takes_the_ranges_without_torch_or_cuda_packages():
    steps = plan("test", gpu=False, upgrade=True, torch="2.13.0+cpu", python="py")
    text = steps[-1][1]
    lines = text.splitlines()
    assert "torch>=2.6" not in lines and not [line for line in lines if line.startswith("nvidia-cudnn")]
    assert "pytest" in lines and any(line.startswith("bitsandbytes") for line in lines)
    assert not re.search(r"^[\w-]+==", text, re.M)   # ranges, not pins
    fresh = plan("suite", gpu=False, upgrade=True, torch=None, python="py", cpu_index="https://mirror/cpu")
    assert _commands(fresh) == [["py", "-m", "pip", "install", "torch", "--index-url", "https://mirror/cpu"]]


def test_the_notebook_installs_its_lock_or_with_upgrade_its_ranges():
    assert plan("notebook", gpu=False, upgrade=False, torch=None, python="py")[0][0].endswith("locked")
    assert "-U" in _commands(plan("notebook", gpu=True, upgrade=True, torch=None, python="py"))[0]


def test_a_missing_lock_is_an_error_that_names_the_fix(tree):
    os.remove(tree / "requirements-test.lock")
    with pytest.raises(InstallError, match="make lock"):
        plan("test", gpu=False, upgrade=False, torch="2.13.0+cpu", python="py", root=str(tree))


@pytest.mark.parametrize("gpu, torch_version, lock", [(False, "2.13.0+cpu", "requirements-cpu.lock"),
                                                      (True, None, "requirements.lock")])
def test_install_runs_pip_on_the_lock_with_require_hashes(monkeypatch, gpu, torch_version, lock):
    ran = []

    def fake_run(command, **_):
        files = [command[i + 1] for i, a in enumerate(command) if a == "-r"]
        ran.append((command, [open(f).read() for f in files]))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(install.subprocess, "run", fake_run)
    monkeypatch.setattr(install, "has_gpu", lambda: gpu)
    monkeypatch.setattr(install, "installed_torch", lambda: torch_version)
    assert install.install("suite", upgrade=False, python="py") == 0
    ((command, (text,)),) = ran
    assert command[:5] == ["py", "-m", "pip", "install", "--require-hashes"]
    with open(os.path.join(ROOT, lock)) as f:
        assert text == f.read()


def test_install_refuses_a_stale_lock_naming_make_lock(monkeypatch):
    monkeypatch.setattr(install, "stale", lambda: ["requirements-cpu.lock is older than requirements.txt: run make lock"])
    with pytest.raises(InstallError, match="run make lock"):
        install.install("suite", upgrade=False)


def test_install_imports_the_standard_library_only():
    # It runs before anything is installed, with a bare Python.
    import ast
    import sys
    tree = ast.parse(open(install.__file__).read())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - {"uv"} <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_the_tests_without_any_torch_get_the_locked_cpu_build():
    steps = plan("test", gpu=False, upgrade=False, torch=None, python="py", cpu_index="https://mirror/cpu")
    assert _commands(steps) == [["py", "-m", "pip", "install", f"torch=={install.TORCH['cpu']}",
                                 "--index-url", "https://mirror/cpu"]]


def test_a_stale_notebook_lock_does_not_block_the_suites_install(monkeypatch):
    monkeypatch.setattr(install, "stale", lambda: ["requirements-notebook.lock is older than requirements-notebook.txt: "
                                                   "run make lock, and commit both"])
    monkeypatch.setattr(install, "has_gpu", lambda: False)
    monkeypatch.setattr(install, "installed_torch", lambda: f"{install.TORCH['cpu']}+cpu")
    monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: type("Done", (), {"returncode": 0})())
    assert install.install("suite", upgrade=False, python="py") == 0
    with pytest.raises(InstallError, match="requirements-notebook.lock"):
        install.install("notebook", upgrade=False, python="py")
