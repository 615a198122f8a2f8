"""The max rung: the fused rung plus every addition that paid on an H200 (Utils.ladder.registry.RUNGS["max"])."""
import sys

from Utils.train.run import main

if __name__ == "__main__":
    sys.exit(main("max"))
