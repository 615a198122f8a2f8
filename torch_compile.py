"""The torch_compile rung: + torch.compile (Utils.ladder.registry.RUNGS["torch_compile"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("torch_compile"))
