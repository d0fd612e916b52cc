#!/usr/bin/env python3
"""Checks the structure of the Grafana dashboards in deploy/grafana/dashboards.

Usage: check_dashboards.py deploy

No Grafana runs in CI, so this checks what Grafana would otherwise show as broken or misleading:
valid JSON with a unique uid; the `datasource` variable (type prometheus) and the instance
variables `router_instance`, `worker_instance` and `frontend_instance`; every panel and every query bound to
${datasource}; unique panel ids and query refIds; panels inside the 24-column grid and not
overlapping; every query on router metrics filtered by $router_instance and on worker metrics by
$worker_instance, on front-end metrics by $frontend_instance; every layer panel of a dashboard with a `layer` variable filtered by it;
heatmaps fed by _bucket series in heatmap format. The provisioning files must point Grafana at
these dashboards and at a Prometheus datasource.
"""
import json
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promql  # noqa: E402

DS_REF = {"type": "prometheus", "uid": "${datasource}"}


def check_dashboard(path, problems, uids):
    base = os.path.basename(path)

    def fail(msg):
        problems.append(f"{base}: {msg}")

    try:
        dash = json.load(open(path))
    except json.JSONDecodeError as e:
        fail(f"not valid JSON: {e}")
        return 0
    if not dash.get("uid") or dash["uid"] in uids:
        fail(f"missing or duplicate uid {dash.get('uid')!r}")
    uids.add(dash.get("uid"))
    variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        fail("needs a `datasource` variable of type datasource, query prometheus")
    for name in ("router_instance", "worker_instance", "frontend_instance"):
        v = variables.get(name)
        if not v or v.get("datasource") != DS_REF or "instance" not in json.dumps(v.get("query")):
            fail(f"needs a `{name}` query variable over the instance label, bound to ${{datasource}}")
    has_layer = "layer" in variables

    ids, boxes, n_queries = set(), [], 0
    for p in promql.panels(dash):
        title = p.get("title", "?")
        if p.get("id") in ids:
            fail(f"panel {title!r}: duplicate id {p.get('id')}")
        ids.add(p.get("id"))
        g = p.get("gridPos", {})
        if not all(k in g for k in "hwxy") or g["x"] < 0 or g["x"] + g["w"] > 24:
            fail(f"panel {title!r}: gridPos {g} outside the 24-column grid")
        else:
            for other_title, o in boxes:
                if (g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"] and
                        g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"]):
                    fail(f"panel {title!r} overlaps {other_title!r}")
            boxes.append((title, g))
        if p.get("type") == "row":
            continue
        if p.get("datasource") != DS_REF:
            fail(f"panel {title!r}: datasource must be ${{datasource}}")
        targets = p.get("targets", [])
        if not targets:
            fail(f"panel {title!r}: no query")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            fail(f"panel {title!r}: duplicate refIds {refs}")
        for t in targets:
            n_queries += 1
            expr = t.get("expr", "")
            if t.get("datasource") != DS_REF:
                fail(f"panel {title!r} {t.get('refId')}: datasource must be ${{datasource}}")
            e = promql.parse(title, expr)
            for m in e.metrics:
                if m.startswith("exl3_router_") and "$router_instance" not in expr:
                    fail(f"panel {title!r}: {m} not filtered by $router_instance")
                if m.startswith("exl3_worker_") and "$worker_instance" not in expr:
                    fail(f"panel {title!r}: {m} not filtered by $worker_instance")
                if m.startswith("exl3_frontend_") and "$frontend_instance" not in expr:
                    fail(f"panel {title!r}: {m} not filtered by $frontend_instance")
                if m == "up" and "$worker_instance" not in expr and "$router_instance" not in expr:
                    fail(f"panel {title!r}: up not filtered by an instance variable")
            if has_layer and "layer_latency_seconds" in expr and "$layer" not in expr:
                fail(f"panel {title!r}: per-layer query not filtered by $layer")
            if p.get("type") == "heatmap" and (t.get("format") != "heatmap" or "_bucket" not in expr):
                fail(f"panel {title!r}: a heatmap needs _bucket series in heatmap format")
    return n_queries


def main():
    deploy = sys.argv[1] if len(sys.argv) > 1 else "deploy"
    problems, uids, total = [], set(), 0
    files = promql.dashboard_files(deploy)
    if not files:
        problems.append("no dashboards in deploy/grafana/dashboards")
    for path in files:
        total += check_dashboard(path, problems, uids)

    prov_dir = os.path.join(deploy, "grafana", "provisioning")
    ds = yaml.safe_load(open(os.path.join(prov_dir, "datasources", "prometheus.yml")))
    if not any(d.get("type") == "prometheus" for d in ds.get("datasources", [])):
        problems.append("provisioning/datasources: no Prometheus datasource")
    dp = yaml.safe_load(open(os.path.join(prov_dir, "dashboards", "exl3.yml")))
    if not dp.get("providers") or dp["providers"][0].get("type") != "file":
        problems.append("provisioning/dashboards: needs a file provider")
    print(f"check_dashboards: {len(files)} dashboards, {total} queries")
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
