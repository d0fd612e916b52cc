"""The PromQL expressions that deploy/ uses, and the metric and label names in them.

Collects every expression of the recording rules, the alerts and the Grafana dashboards (panel
targets and template variable queries) and splits each into the names it uses, with a small lexer
for the part of PromQL those files use (selectors, functions, aggregations with by/without,
binary operators with on/ignoring/group_*). Used by the checks in scripts/checks/deploy.sh.
"""
import json
import os
import re
from dataclasses import dataclass, field

import yaml

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
            "group_left", "group_right", "inf", "nan", "atan2", "start", "end"}
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                "bottomk", "topk", "quantile"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# Labels every scraped series carries; `le` belongs to _bucket series.
TARGET_LABELS = {"job", "instance"}

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?)([smhdwy]|ms)?")
_VAR = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Expr:
    where: str  # file and rule/panel, for messages
    text: str
    metrics: dict = field(default_factory=dict)     # metric name -> set of matcher label names
    grouping_labels: set = field(default_factory=set)
    functions: set = field(default_factory=set)


def _skip_string(s, i):
    q = s[i]
    i += 1
    while i < len(s) and s[i] != q:
        i += 2 if s[i] == "\\" else 1
    if i >= len(s):
        raise ValueError("unterminated string")
    return i + 1


def parse(where, text):
    """Splits one PromQL expression into metric names, matcher labels and grouping labels."""
    e = Expr(where, text)
    s, i, n = text, 0, len(text)
    last_metric = None
    while i < n:
        c = s[i]
        if c.isspace():
            i += 1
        elif c in "\"'`":
            i = _skip_string(s, i)
        elif c == "$":
            m = _VAR.match(s, i)
            i = m.end() if m else i + 1
        elif c == "[":  # range or subquery duration
            j = s.index("]", i)
            i = j + 1
        elif c == "{":  # label matchers of the metric just before (or of a bare {__name__=...})
            j = i + 1
            labels = set()
            while True:
                while j < n and s[j] in " \t\n,":
                    j += 1
                if j >= n:
                    raise ValueError(f"unterminated selector in {text!r}")
                if s[j] == "}":
                    j += 1
                    break
                m = _IDENT.match(s, j)
                if not m:
                    raise ValueError(f"bad matcher at {s[j:j + 20]!r} in {text!r}")
                labels.add(m.group(0))
                j = m.end()
                while j < n and s[j] in " \t":
                    j += 1
                op = re.match(r"=~|!~|!=|=", s[j:])
                if not op:
                    raise ValueError(f"bad matcher operator in {text!r}")
                j += len(op.group(0))
                while j < n and s[j] in " \t":
                    j += 1
                if j >= n or s[j] not in "\"'`":
                    raise ValueError(f"matcher value must be a string in {text!r}")
                j = _skip_string(s, j)
            if last_metric is not None:
                e.metrics[last_metric] |= labels
            i = j
            last_metric = None
            continue
        elif c.isdigit() or (c == "." and i + 1 < n and s[i + 1].isdigit()):
            m = _NUMBER.match(s, i)
            i = m.end()
        elif c.isalpha() or c in "_:":
            m = _IDENT.match(s, i)
            word = m.group(0)
            j = m.end()
            while j < n and s[j].isspace():
                j += 1
            follows_paren = j < n and s[j] == "("
            if word.lower() in GROUPING:
                if follows_paren:
                    k = s.index(")", j)
                    for lab in re.split(r"[\s,]+", s[j + 1:k].strip()):
                        if lab:
                            e.grouping_labels.add(lab)
                    i = k + 1
                else:
                    i = j
                last_metric = None
                continue
            if word.lower() in KEYWORDS:
                i = m.end()
            elif follows_paren or word in AGGREGATIONS:
                e.functions.add(word)
                i = m.end()
            else:
                e.metrics.setdefault(word, set())
                last_metric = word
                i = m.end()
                continue
        else:
            i += 1
        last_metric = None
    return e


def _label_values_query(where, q):
    """Grafana's label_values(metric, label) -> the PromQL it stands for."""
    m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q)
    if not m:
        return parse(where, q)
    e = parse(where, f"group by ({m.group(2)}) ({m.group(1)})")
    return e


def rule_files(deploy_dir):
    d = os.path.join(deploy_dir, "prometheus", "rules")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith((".yml", ".yaml")))


def rule_exprs(deploy_dir):
    """(recorded names, [Expr]) over every rule file."""
    recorded, exprs = set(), []
    for path in rule_files(deploy_dir):
        doc = yaml.safe_load(open(path))
        for g in doc["groups"]:
            for r in g["rules"]:
                name = r.get("record") or r.get("alert")
                where = f"{os.path.relpath(path, deploy_dir)}: {name}"
                exprs.append(parse(where, r["expr"]))
                if "record" in r:
                    recorded.add(r["record"])
    return recorded, exprs


def dashboard_files(deploy_dir):
    d = os.path.join(deploy_dir, "grafana", "dashboards")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".json"))


def panels(dash):
    for p in dash.get("panels", []):
        yield p
        for q in p.get("panels", []):  # panels inside collapsed rows
            yield q


def dashboard_exprs(deploy_dir):
    exprs = []
    for path in dashboard_files(deploy_dir):
        dash = json.load(open(path))
        base = os.path.basename(path)
        for v in dash.get("templating", {}).get("list", []):
            if v.get("type") == "query":
                q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                exprs.append(_label_values_query(f"{base}: variable {v['name']}", q))
        for p in panels(dash):
            for t in p.get("targets", []):
                exprs.append(parse(f"{base}: panel {p['title']!r} {t['refId']}", t["expr"]))
    return exprs


def grafana_to_promql(text, rate_interval="30s"):
    """Replaces Grafana's variables by values a plain Prometheus accepts (all instances/layers)."""
    text = text.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    text = re.sub(r"\$\{?(router_instance|worker_instance|frontend_instance|layer)\}?", ".*", text)
    m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", text)
    if m:
        text = f"group by ({m.group(2)}) ({m.group(1)})"
    return text


def base_metric(name):
    """exl3_x_seconds_bucket -> (exl3_x_seconds, 'bucket'); others -> (name, '')."""
    for suf in ("_bucket", "_sum", "_count"):
        if name.endswith(suf):
            return name[: -len(suf)], suf[1:]
    return name, ""
