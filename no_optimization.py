"""The baseline: fp32 with TF32 off, attention written out, eager, torch.optim.AdamW as shipped."""
import sys

from Utils.recipes import BASELINE
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(BASELINE))
