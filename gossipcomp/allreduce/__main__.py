"""`python -m gossipcomp.allreduce ...`: the `gossipcomp allreduce` command on its own."""

import sys

from gossipcomp.allreduce.command import add_arguments, run
from gossipcomp.inputs.arguments import Parser


def main() -> int:
    parser = Parser(prog="gossipcomp allreduce", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
