"""The fused rung: + AdamW(fused=True) (Utils.ladder.registry.RUNGS["fused"])."""
import sys

from Utils.train.run import main

if __name__ == "__main__":
    sys.exit(main("fused"))
