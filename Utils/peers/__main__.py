"""python -m Utils.peers NAME --steps n --batch-size b --prefix dir [the rung scripts' other options]

(make peers STEPS=n BATCH_SIZE=b PREFIX=dir [PEERS="llmc hf"].) Runs the peer NAME (llmc or hf) and records
it in PREFIX's results as peer-NAME; the exit status is the rung scripts' (4: skipped, with the reason).
"""
import shlex
import sys

from Utils.peers import PEERS
from Utils.train.usage import fail


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in PEERS:
        got = f"'{argv[0]}'" if argv else "nothing"
        return fail(f"python -m Utils.peers needs a peer first, one of {', '.join(PEERS)}, not {got} "
                    f"(e.g. make peers STEPS=30 BATCH_SIZE=16 PREFIX=./out PEERS=hf)")
    name, rest = argv[0], argv[1:]
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "Utils.peers", *argv])
    if name == "hf":
        from Utils.peers import hf
        return hf.main(rest, command)
    from Utils.peers import llmc
    return llmc.main(rest, command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
