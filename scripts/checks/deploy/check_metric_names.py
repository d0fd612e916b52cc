#!/usr/bin/env python3
"""Checks that every metric and label name used by deploy/ exists.

Usage:
  check_metric_names.py --deploy deploy --doc docs/metrics.md [--live router.txt worker.txt ...]

Reads every PromQL expression of the recording rules, alerts and Grafana dashboards (panels and
template variables) and checks each metric name against
  - docs/metrics.md, the contract (always), and
  - the /metrics text of running binaries (--live, one file per scraped process), where given:
    a name must be exported by at least one of them.
Histograms must be used through _bucket/_sum/_count, never by their bare name; names with a
colon must be recording rules defined in deploy/prometheus/rules; label names in selectors and in
by/without/on/ignoring must belong to the metrics the expression uses (or be job/instance/le).
Exit status 1 with one line per problem.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promql  # noqa: E402


def families_from_doc(path):
    fams = {}
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        m = re.match(r"\|\s*`(exl3_[a-z0-9_]+)`\s*\|\s*([a-z]+)[^|]*\|([^|]*)\|", line)
        if not m:
            continue
        labels_col = re.sub(r"\(.*?\)", "", m.group(3)).split("=")[0]
        labels = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", labels_col))
        fams[m.group(1)] = (m.group(2), labels)
    return fams


_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+\S+")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def families_from_exposition(text):
    """Prometheus text format -> {family: (type, label names)} and {sample name: label names}."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(None, 3)
            types[name] = typ.strip()
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            if m:
                labels = {k for k, _ in _LABEL.findall(m.group(3) or "")}
                samples.setdefault(m.group(1), set()).update(labels)
    fams = {}
    for name, typ in types.items():
        labels = set()
        for sname in ([name + "_bucket", name + "_sum", name + "_count"] if typ == "histogram"
                      else [name]):
            labels |= samples.get(sname, set())
        labels.discard("le")
        fams[name] = (typ, labels)
    return fams


def check(exprs, recorded, fams, source):
    """Problems with the names in exprs against the families of one source (doc or live)."""
    problems = []
    for e in exprs:
        known_labels = set(promql.TARGET_LABELS)
        any_recorded = False
        for name, matcher_labels in e.metrics.items():
            if ":" in name:
                any_recorded = True
                if name not in recorded:
                    problems.append(f"{e.where}: {name} is not a recording rule in deploy/prometheus/rules")
                continue
            if name == "up":  # Prometheus's own per-target series
                continue
            base, suffix = promql.base_metric(name)
            if name in fams:
                typ, labels = fams[name]
                if typ == "histogram":
                    problems.append(f"{e.where}: histogram {name} used without _bucket/_sum/_count")
                    continue
            elif base in fams and fams[base][0] == "histogram" and suffix:
                typ, labels = fams[base]
                if suffix == "bucket":
                    labels = labels | {"le"}
            else:
                problems.append(f"{e.where}: metric {name} not found in {source}")
                continue
            known_labels |= labels
            bad = matcher_labels - labels - promql.TARGET_LABELS - {"__name__"}
            if bad:
                problems.append(f"{e.where}: {name} has no label {', '.join(sorted(bad))} in {source}")
        if not any_recorded:
            bad = e.grouping_labels - known_labels
            if bad:
                problems.append(f"{e.where}: grouping by {', '.join(sorted(bad))}, "
                                f"which no metric of the expression has in {source}")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deploy", required=True)
    ap.add_argument("--doc", required=True)
    ap.add_argument("--live", nargs="*", default=[], help="/metrics text files of running binaries")
    args = ap.parse_args()

    recorded, rexprs = promql.rule_exprs(args.deploy)
    dexprs = promql.dashboard_exprs(args.deploy)
    exprs = rexprs + dexprs
    doc = families_from_doc(args.doc)
    if not doc:
        print(f"check_metric_names: no metric table found in {args.doc}", file=sys.stderr)
        return 1
    problems = check(exprs, recorded, doc, args.doc)

    used = set()
    for e in exprs:
        for name in e.metrics:
            used.add(promql.base_metric(name)[0] if promql.base_metric(name)[0] in doc else name)
    unused = sorted(set(doc) - used)

    if args.live:
        live = {}
        for path in args.live:
            for name, (typ, labels) in families_from_exposition(open(path).read()).items():
                old = live.get(name, (typ, set()))
                live[name] = (typ, old[1] | labels)
        problems += check(exprs, recorded, live, "the live /metrics (" + ", ".join(args.live) + ")")
        # The contract itself: report names documented but not exported, and type mismatches.
        for name, (typ, _) in sorted(doc.items()):
            if name not in live:
                print(f"note: {name} is in {args.doc} but in no live /metrics")
            elif live[name][0] != typ:
                print(f"note: {name} is a {live[name][0]} in /metrics but a {typ} in {args.doc}")

    n_metrics = len({n for e in exprs for n in e.metrics})
    print(f"check_metric_names: {len(rexprs)} rule and {len(dexprs)} dashboard expressions, "
          f"{n_metrics} distinct names, checked against {args.doc}"
          + (f" and {len(args.live)} live /metrics" if args.live else ""))
    if unused:
        print("note: documented metrics no rule or dashboard uses: " + ", ".join(unused))
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
