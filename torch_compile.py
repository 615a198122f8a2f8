"""The torch_compile rung: + torch.compile (Utils.ladder.registry.RUNGS["torch_compile"])."""
import sys

from Utils.train.run import main

if __name__ == "__main__":
    sys.exit(main("torch_compile"))
