"""torch.compile plus F.scaled_dot_product_attention (flash kernels)."""
import sys

from Utils.recipes import FLASH
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(FLASH))
