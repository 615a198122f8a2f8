"""The tf32 rung: + TF32 matmuls (Utils.ladder.registry.RUNGS["tf32"])."""
import sys

from Utils.train.run import main

if __name__ == "__main__":
    sys.exit(main("tf32"))
