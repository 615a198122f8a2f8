"""How a run's exceptions are named in runs.csv and on the terminal: out of memory (status oom), torch.compile's
own failures (skipped at the first step), and the one line a message keeps of any exception."""
import torch


# How memory outside PyTorch's allocator runs out: the CPU allocator's plain RuntimeError, the CUDA runtime's own
# error (a kernel's or library's allocation), cuBLAS's workspace, Triton's launcher.
OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                       "[CUDA]: out of memory")


def out_of_memory(e: BaseException) -> bool:
    """Out of device memory, or of host memory (OUT_OF_MEMORY_TEXTS: errors that are no OutOfMemoryError), also where
    torch.compile wraps it: Inductor runs the graph it is compiling, and an OOM there reaches the caller as a
    BackendCompilerFailed whose cause is the OOM."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (isinstance(e, RuntimeError) and any(
                text in str(e) for text in OUT_OF_MEMORY_TEXTS)):
            return True
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__
    return False


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
