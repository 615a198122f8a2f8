"""Inductor's and AOTAutograd's caches around a run: whether its graphs were compiled or loaded (the record's
compile_cache), COLD=1's empty cache of its own, and no AOTAutograd cache where SDPA_BACKEND is pinned.
"""
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator


def compile_counts() -> tuple[int, int]:
    """(graphs loaded from Inductor's caches, graphs compiled) so far in this process: torch's own counters
    of its FX graph and AOTAutograd caches (a bypass compiles, as a miss does)."""
    from torch._dynamo.utils import counters
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    compiled = sum(counters[group][f"{kind}_cache_{what}"] for group, kind in
                   (("inductor", "fxgraph"), ("aot_autograd", "autograd")) for what in ("miss", "bypass"))
    return hits, compiled


def compile_cache(before: tuple[int, int]) -> str | None:
    """Since compile_counts() returned `before`: warm when every graph came from the caches, cold when every one
    was compiled, partial when some were (a graph the cache bypasses, e.g. one around a CUDA graph's custom
    kernels, compiles every time); None when there was nothing to compile."""
    hits, compiled = (now - then for now, then in zip(compile_counts(), before))
    if not hits and not compiled:
        return None
    return "partial" if hits and compiled else "cold" if compiled else "warm"


@contextlib.contextmanager
def cold_caches(cold: bool) -> Iterator[Callable[[], None]]:
    """With `cold`, Inductor and Triton compile into an empty folder of their own, removed afterwards: the
    compile time of a fresh machine (make ... COLD=1). Yields `renew`, which moves them to another empty folder:
    after MICRO_BATCH=auto's tries have compiled, the measured run still compiles cold."""
    if not cold:
        yield lambda: None
        return
    folders = []

    def renew() -> None:
        folders.append(tempfile.mkdtemp(prefix="cold-compile-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folders[-1]
        os.environ["TRITON_CACHE_DIR"] = os.path.join(folders[-1], "triton")

    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    renew()
    try:
        yield renew
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def autograd_cache_unless(pinned: bool) -> Iterator[None]:
    """With SDPA_BACKEND pinned, no AOTAutograd cache: its key is the graph before SDPA picks a kernel, so it
    hands back a graph compiled under PyTorch's own choice (BENCHMARKS.md, "Which attention kernel the `flash`
    rung runs"). Traced again, the graph holds the pinned kernel's operator, which Inductor's own cache keys on."""
    if not pinned:
        yield
        return
    import torch._functorch.config as functorch_config
    with functorch_config.patch(enable_autograd_cache=False):
        yield
