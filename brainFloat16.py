"""The bf16 rung: + bf16 autocast (Utils.ladder.registry.RUNGS["bf16"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("bf16"))
