"""The 8bit rung: the flash rung with bitsandbytes' AdamW8bit (Utils.ladder.registry.RUNGS["8bit"])."""
import sys

from Utils.train.run import main

if __name__ == "__main__":
    sys.exit(main("8bit"))
