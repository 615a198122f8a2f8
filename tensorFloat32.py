"""The tf32 rung: + TF32 matmuls (Utils.ladder.registry.RUNGS["tf32"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("tf32"))
