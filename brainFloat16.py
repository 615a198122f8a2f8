"""TF32 plus bf16 autocast."""
import sys

from Utils.recipes import BF16
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(BF16))
