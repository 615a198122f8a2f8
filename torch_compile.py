"""bf16 plus torch.compile."""
import sys

from Utils.recipes import TORCH_COMPILE
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(TORCH_COMPILE))
