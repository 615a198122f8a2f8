"""Lists the largest tensors a rung's training step keeps for its backward pass, as the rung builds its model
(compiled where the rung compiles): where a rung's peak memory goes beyond the weights and optimizer states.
It runs on a CPU too, at a small model with GPT-2's vocabulary, since what is kept depends on the graph, not
on the device; sizes scale with batch x sequence length.

    python3 bench/saved_tensors.py fused --batch-size 4 --seq-len 128 --device cpu
    python3 bench/saved_tensors.py fused --add loss      (the fused rung with the chunked loss)
"""
import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Utils.ladder.apply import build  # noqa: E402
from Utils.ladder.registry import RUNGS, RegistryError, resolve, run_name  # noqa: E402
from Utils.model_config import PRESETS  # noqa: E402


def saved_by_step(additions: tuple, model: str, batch: int, seq_len: int, device: torch.device) -> list[tuple]:
    """(shape, dtype, bytes) of every tensor a step of these additions saves for backward, largest first (the
    second step's: the first compiles)."""
    config = replace(PRESETS[model], block_size=seq_len)
    b = build(additions, device, config, seed=0, loader=None)
    x, y = (torch.randint(0, config.vocab_size, (batch, seq_len), device=device) for _ in range(2))
    saved = []

    def keep(t):
        saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    for _ in range(2):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), b.autocast():
            _, loss = b.step_model(x, y)
        loss.backward()
    return sorted(saved, key=lambda s: -s[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rung", choices=list(RUNGS))
    parser.add_argument("--add", nargs="*", default=[], metavar="ADDITION", help="additions on top of the rung")
    parser.add_argument("--model", default="tiny", choices=list(PRESETS), help="default: %(default)s, GPT-2's vocabulary")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    try:
        additions = resolve(RUNGS[args.rung].additions + tuple(args.add))
    except RegistryError as e:
        sys.exit(f"error: {e}")
    saved = saved_by_step(additions, args.model, args.batch_size, args.seq_len, torch.device(args.device))
    tokens = args.batch_size * args.seq_len
    print(f"{run_name(additions)}: {len(saved)} saves for backward at {tokens} tokens, "
          f"{sum(s[2] for s in saved) / 2 ** 20:.1f} MiB counting a tensor each time it is saved; the largest:")
    for shape, dtype, nbytes in saved[:args.top]:
        print(f"  {str(list(shape)):20s} {str(dtype).removeprefix('torch.'):9s} {nbytes / 2 ** 20:9.2f} MiB")


if __name__ == "__main__":
    main()
