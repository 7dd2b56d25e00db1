#!/usr/bin/env python3
"""Build tests/data/docs_pages.warc.gz: real documentation pages that the FineWeb/Gopher rules used to drop.

Pages of the Debian FAQ in eight languages, the Debian New Maintainers' Guide (shell sessions, Makefiles)
and the Python 3.11 documentation (code examples), from Debian 12's packages:

    apt-get install python3.11-doc maint-guide maint-guide-zh-cn \\
        debian-faq debian-faq-{de,fr,ja,ko,nl,pt,ru,zh-cn}
    python scripts/make_docs_fixture.py

Before the fixes that came with this file, Kiln's default gates kept none of them (fineweb_dup_line_chars:
tables of contents and navigation bars repeat the headings, code repeats lines; gopher_dup_ngrams;
gopher_stop_words on Korean). The pages are GPL-2+ (Debian FAQ, Maintainers' Guide) and PSF-licensed
(Python documentation). The output is reproducible byte for byte (benchmarks/debian_docs.write_warc).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.debian_docs import page_url, write_warc

PAGES = [
    ("debian-faq", "usr/share/doc/debian/FAQ/de/basic-defs.de.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/fr/compatibility.fr.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/ja/getting-debian.ja.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/ko/kernel.ko.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/ko/support.ko.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/nl/getting-debian.nl.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/pt/kernel.pt.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/ru/kernel.ru.html"),
    ("debian-faq", "usr/share/doc/debian/FAQ/zh-cn/getting-debian.zh-cn.html"),
    ("maint-guide", "usr/share/doc/maint-guide/html/modify.en.html"),
    ("maint-guide", "usr/share/doc/maint-guide-zh-cn/html/modify.zh-cn.html"),
    ("python", "usr/share/doc/python3.11/html/library/asyncio-dev.html"),
    ("python", "usr/share/doc/python3.11/html/library/copyreg.html"),
    ("python", "usr/share/doc/python3.11/html/library/graphlib.html"),
    ("python", "usr/share/doc/python3.11/html/tutorial/venv.html"),
    ("python", "usr/share/doc/python3.11/html/howto/sorting.html"),
]
DEFAULT_OUT = ROOT / "tests" / "data" / "docs_pages.warc.gz"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/"), help="where the packages are installed or unpacked")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    missing = [rel for _, rel in PAGES if not (args.root / rel).is_file()]
    if missing:
        print(f"missing pages (install the packages in this script's docstring): {missing}", file=sys.stderr)
        return 1
    pages = [(page_url(args.root / rel, corpus), (args.root / rel).read_bytes()) for corpus, rel in PAGES]
    write_warc(args.out, pages)
    print(f"{args.out}: {len(pages)} pages, {args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
