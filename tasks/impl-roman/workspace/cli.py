"""python3 cli.py 1994 -> MCMXCIV; python3 cli.py XLII -> 42."""
import sys

from numerals import from_roman, to_roman


def main(argv):
    for arg in argv:
        print(to_roman(int(arg)) if arg.isdigit() else from_roman(arg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
