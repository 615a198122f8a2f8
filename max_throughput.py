"""The max rung: the fused rung plus every addition that paid on an H100 or H200
(Utils.ladder.registry.RUNGS["max"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("max"))
