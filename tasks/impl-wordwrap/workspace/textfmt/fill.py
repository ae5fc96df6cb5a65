"""python3 -m textfmt.fill WIDTH < text: print the text wrapped to WIDTH columns."""

import sys

from .wrap import wrap

if __name__ == "__main__":
    for line in wrap(sys.stdin.read(), int(sys.argv[1])):
        print(line)
