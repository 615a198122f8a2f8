"""The bf16 rung: + bf16 autocast (Utils.ladder.registry.RUNGS["bf16"])."""
import sys

from Utils.train.run import main

if __name__ == "__main__":
    sys.exit(main("bf16"))
