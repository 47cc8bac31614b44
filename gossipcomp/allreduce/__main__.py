"""`python -m gossipcomp.allreduce ...`: the `gossipcomp allreduce` command on its own."""

import argparse
import sys
from typing import NoReturn

from gossipcomp.allreduce.command import add_arguments, run


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as gossipcomp's other commands
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main() -> int:
    parser = _Parser(prog="gossipcomp allreduce", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
