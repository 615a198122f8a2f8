"""Beyond the seven: the fused rung plus every further change that pays on a GPU (Utils.recipes.MAX)."""
import sys

from Utils.recipes import MAX
from Utils.runner import main

if __name__ == "__main__":
    sys.exit(main(MAX))
