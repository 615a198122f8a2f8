"""The baseline with TF32 matmuls on the tensor cores."""
import sys

from Utils.recipes import TF32
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(TF32))
