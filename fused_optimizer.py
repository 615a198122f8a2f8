"""FlashAttention plus AdamW(fused=True)."""
import sys

from Utils.recipes import FUSED
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(FUSED))
