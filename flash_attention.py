"""The flash rung: + F.scaled_dot_product_attention (FlashAttention) (Utils.ladder.registry.RUNGS["flash"])."""
import sys

from Utils.train.launch import launch

if __name__ == "__main__":
    sys.exit(launch("flash"))
