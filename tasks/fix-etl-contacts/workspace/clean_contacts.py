"""python3 clean_contacts.py IN.csv OUT.csv REJECTS.csv: normalise a contacts export."""

import csv
import re
import sys
from datetime import date

EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


def norm_phone(text):
    digits = re.sub(r"\D", "", text)
    if len(digits) == 10:
        return "+1" + digits
    return None


def norm_date(text):
    text = text.strip()
    m = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})", text)
    if m:
        y, mo, d = m.groups()
    else:
        m = re.fullmatch(r"(\d{2})/(\d{2})/(\d{4})", text)
        if not m:
            return None
        d, mo, y = m.groups()
    try:
        return date(int(y), int(mo), int(d)).isoformat()
    except ValueError:
        return None


def main(argv):
    src, out, rej = argv
    seen = set()
    with open(src) as f, open(out, "w") as fo, open(rej, "w") as fr:
        rows = csv.DictReader(f)
        good = csv.writer(fo)
        bad = csv.writer(fr)
        good.writerow(["name", "email", "phone", "signup"])
        bad.writerow(["line", "reason"])
        for i, row in enumerate(rows, 2):
            name = row["name"].strip()
            email = row["email"].strip()
            phone = norm_phone(row["phone"])
            signup = norm_date(row["signup"])
            if not name:
                reason = "name"
            elif not EMAIL.match(email):
                reason = "email"
            elif email in seen:
                reason = "duplicate"
            elif phone is None:
                reason = "phone"
            elif signup is None:
                reason = "signup"
            else:
                seen.add(email)
                good.writerow([name, email.lower(), phone, signup])
                continue
            bad.writerow([i, reason])


if __name__ == "__main__":
    main(sys.argv[1:])
