"""How a run's exceptions are named in runs.csv and on the terminal: out of memory (status oom), torch.compile's
own failures (skipped at the first step), and the one line a message keeps of any exception."""
import re
from collections.abc import Iterator

import torch


# How memory outside PyTorch's allocator runs out: the CPU allocator's plain RuntimeError, the CUDA runtime's own
# error (a kernel's or library's allocation), cuBLAS's workspace, Triton's launcher.
OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                       "[CUDA]: out of memory")


def causes(e: BaseException | None) -> Iterator[BaseException]:
    """e, then what it wraps: torch.compile's wrappers keep the real error as inner_exception, others as
    __cause__. Each once, so that a cycle ends."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = getattr(e, "inner_exception", None) or e.__cause__


def out_of_memory(e: BaseException) -> bool:
    """Out of device memory, or of host memory (OUT_OF_MEMORY_TEXTS: errors that are no OutOfMemoryError), also where
    torch.compile wraps it: Inductor runs the graph it is compiling, and an OOM there reaches the caller as a
    BackendCompilerFailed whose cause is the OOM."""
    return any(isinstance(c, (torch.OutOfMemoryError, MemoryError))
               or (isinstance(c, RuntimeError) and any(text in str(c) for text in OUT_OF_MEMORY_TEXTS))
               for c in causes(e))


def allocation(e: BaseException) -> str:
    """' (tried to allocate 6.14 GiB)' from CUDA's out-of-memory message, wrapped or not; '' where none says."""
    for c in causes(e):
        found = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(c))
        if found:
            return f" (tried to allocate {found.group(1)})"
    return ""


def compile_failure(e: BaseException) -> bool:
    """Raised by torch.compile itself (Dynamo or Inductor), not by the code it compiles."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def first_line(e: BaseException) -> str:
    """'Type: first meaningful line' of an exception, looking through the wrappers torch.compile puts around
    the real error (their own first line ends in 'raised:')."""
    while True:
        inner = getattr(e, "inner_exception", None) or e.__cause__
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if inner is not None and (not lines or lines[0].endswith(":")):
            e = inner
            continue
        text = next((ln for ln in lines if not ln.endswith("raised:")), "")
        return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
