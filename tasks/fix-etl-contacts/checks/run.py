"""Visible checks for clean_contacts.py and its outputs (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WANT_CLEAN = ("name,email,phone,signup\nAda Lovelace,ada@example.com,+15551234567,2026-01-15\n"
              "Bob,bob@example.com,+15559876543,2025-12-31\nGus,gus@example.com,+15554445555,2026-01-31\n")
WANT_REJ = "line,reason\n3,email\n4,duplicate\n5,name\n6,phone\n8,signup\n"
fails = []
for rel, want in (("data/clean.csv", WANT_CLEAN), ("data/rejects.csv", WANT_REJ)):
    try:
        with open(os.path.join(ROOT, rel), newline="") as f:
            got = f.read().replace("\r\n", "\n")
    except OSError as e:
        got = "missing (%s)" % e
    if got != want:
        fails.append("%s is %r, want %r" % (rel, got, want))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
