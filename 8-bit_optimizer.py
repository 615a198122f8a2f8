"""The 8bit rung: the flash rung with bitsandbytes' AdamW8bit (Utils.ladder.registry.RUNGS["8bit"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("8bit"))
