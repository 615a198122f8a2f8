"""The fused rung: + AdamW(fused=True) (Utils.ladder.registry.RUNGS["fused"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("fused"))
