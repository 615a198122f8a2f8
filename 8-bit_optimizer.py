"""The flash rung with bitsandbytes' AdamW8bit in place of AdamW."""
import sys

from Utils.recipes import EIGHT_BIT
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(EIGHT_BIT))
