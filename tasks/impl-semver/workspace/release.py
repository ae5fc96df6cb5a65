"""python3 release.py VERSION...: print the highest version given."""
import sys

from semver import sort_versions

if __name__ == "__main__":
    print(sort_versions(sys.argv[1:])[-1])
