#!/usr/bin/env python3
"""Checks that every link in README.md, rust/README.md and docs/**/*.md points to a file that
exists: markdown links and images (relative to the file; http(s) and #anchors skipped) and
paths under docs/ written in the text (relative to the repository root, as the performance log
names its CSV files; a glob such as `name.*` must match something). Other paths in the text are
prose (the log names scripts of its time), not checked.
usage: scripts/check-doc-links.py [FILE.md ...]    exit status 1 when a link is broken."""
import glob
import os
import re
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(root)
files = sys.argv[1:] or (["README.md", "rust/README.md"]
                         + sorted(glob.glob("docs/**/*.md", recursive=True)))
md_link = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
repo_path = re.compile(r"(?<![\w/.-])(docs/[\w.*/-]*[\w*])")
bad = 0
for f in files:
    base = os.path.dirname(f)
    for n, line in enumerate(open(f, encoding="utf-8"), 1):
        for target in md_link.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = os.path.normpath(os.path.join(base, target.split("#")[0]))
            if not os.path.exists(path):
                print(f"{f}:{n}: broken link {target}")
                bad += 1
        for target in repo_path.findall(md_link.sub("", line)):
            target = target.rstrip(".")
            if not glob.glob(target) and not glob.glob(target + "*"):
                print(f"{f}:{n}: no such path {target}")
                bad += 1
print(f"{len(files)} files checked, {bad} broken")
sys.exit(1 if bad else 0)
