#!/usr/bin/env python3
"""Every alert has a severity, a summary, a description and a runbook_url that names a section of
docs/operations.md (GitHub-style heading anchor), and every such section belongs to an alert.

Usage: check_runbooks.py deploy docs/operations.md
"""
import os
import re
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promql  # noqa: E402


def anchors(markdown_path):
    out = set()
    for line in open(markdown_path):
        m = re.match(r"#{1,6}\s+(.*?)\s*$", line)
        if m:
            a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(a)
    return out


def main():
    deploy, doc = sys.argv[1], sys.argv[2]
    problems = []
    if not os.path.exists(doc):
        print(f"FAIL: {doc} does not exist", file=sys.stderr)
        return 1
    have = anchors(doc)
    n = 0
    for path in promql.rule_files(deploy):
        for g in yaml.safe_load(open(path))["groups"]:
            for r in g["rules"]:
                if "alert" not in r:
                    continue
                n += 1
                a, ann = r["alert"], r.get("annotations", {})
                for key in ("summary", "description", "runbook_url"):
                    if not ann.get(key):
                        problems.append(f"{a}: no {key} annotation")
                if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
                    problems.append(f"{a}: severity label must be critical, warning or info")
                url = ann.get("runbook_url", "")
                target, _, anchor = url.partition("#")
                if target != "docs/operations.md" or anchor != a.lower():
                    problems.append(f"{a}: runbook_url {url!r} must be docs/operations.md#{a.lower()}")
                elif anchor not in have:
                    problems.append(f"{a}: docs/operations.md has no section '{a}' (#{anchor})")
    print(f"check_runbooks: {n} alerts, each with a runbook section in {doc}")
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
