"""The baseline rung: fp32, TF32 off, attention written out, eager, torch.optim.AdamW as shipped (Utils.ladder.registry.RUNGS["baseline"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("baseline"))
