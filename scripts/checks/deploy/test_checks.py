#!/usr/bin/env python3
"""Tests of the deploy checkers: each must pass the real deploy/ tree and catch a broken copy.

Usage: test_checks.py --kubectl PATH --check-jsonschema PATH   (run by scripts/checks/deploy.sh)
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, HERE)
import check_metric_names  # noqa: E402
import promql  # noqa: E402

TOOLS = {}


def run_checker(script, *args):
    r = subprocess.run([sys.executable, os.path.join(HERE, script)] + list(args),
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


class BrokenCopy:
    """A copy of deploy/ (and docs/operations.md) in a temporary directory, to break on purpose."""

    def __enter__(self):
        self.tmp = tempfile.mkdtemp(prefix="exl3-deploy-test-")
        self.deploy = os.path.join(self.tmp, "deploy")
        shutil.copytree(os.path.join(REPO, "deploy"), self.deploy)
        os.makedirs(os.path.join(self.tmp, "docs"))
        shutil.copy(os.path.join(REPO, "docs", "operations.md"), os.path.join(self.tmp, "docs"))
        return self

    def edit(self, rel, old, new):
        path = os.path.join(self.tmp, rel)
        with open(path) as f:
            text = f.read()
        assert old in text, f"{old!r} not in {rel}"
        with open(path, "w") as f:
            f.write(text.replace(old, new, 1))

    def __exit__(self, *exc):
        shutil.rmtree(self.tmp)


class PromqlTest(unittest.TestCase):
    def test_names_labels_and_grouping(self):
        e = promql.parse("t", 'histogram_quantile(0.99, sum by (layer, le) (rate('
                              'exl3_worker_layer_latency_seconds_bucket{stage="total", '
                              'instance=~"$worker_instance"}[$__rate_interval]))) '
                              '/ on (layer) group_left max(exl3_x_total offset 5m) > 0.5')
        self.assertEqual(set(e.metrics), {"exl3_worker_layer_latency_seconds_bucket", "exl3_x_total"})
        self.assertEqual(e.metrics["exl3_worker_layer_latency_seconds_bucket"], {"stage", "instance"})
        self.assertEqual(e.grouping_labels, {"layer", "le"})
        self.assertIn("histogram_quantile", e.functions)

    def test_strings_with_braces_are_not_selectors(self):
        e = promql.parse("t", 'label_replace(up{job="a{b}"}, "x", "$1", "job", "(.*)")')
        self.assertEqual(e.metrics, {"up": {"job"}})

    def test_recording_rule_names_keep_colons(self):
        e = promql.parse("t", 'layer_stage:exl3_router_layer_latency_seconds:p99{stage="total"} > 0.025')
        self.assertEqual(e.metrics, {"layer_stage:exl3_router_layer_latency_seconds:p99": {"stage"}})

    def test_grafana_variables(self):
        q = promql.grafana_to_promql('sum(rate(a{instance=~"$router_instance", layer=~"${layer}"}[$__rate_interval]))')
        self.assertEqual(q, 'sum(rate(a{instance=~".*", layer=~".*"}[30s]))')
        self.assertEqual(promql.grafana_to_promql("label_values(exl3_worker_ready, instance)"),
                         "group by (instance) (exl3_worker_ready)")


class MetricNamesTest(unittest.TestCase):
    fams = check_metric_names.families_from_exposition(
        "# TYPE exl3_worker_layer_latency_seconds histogram\n"
        'exl3_worker_layer_latency_seconds_bucket{layer="1",stage="total",le="0.001"} 3\n'
        'exl3_worker_layer_latency_seconds_sum{layer="1",stage="total"} 0.5\n'
        'exl3_worker_layer_latency_seconds_count{layer="1",stage="total"} 3\n'
        "# TYPE exl3_worker_errors_total counter\n"
        'exl3_worker_errors_total{code="UNAVAILABLE"} 0\n'
        "# TYPE exl3_worker_queue_depth gauge\nexl3_worker_queue_depth 0\n")

    def problems(self, expr, recorded=()):
        return check_metric_names.check([promql.parse("t", expr)], set(recorded), self.fams, "live")

    def test_exposition_parsing(self):
        self.assertEqual(self.fams["exl3_worker_layer_latency_seconds"], ("histogram", {"layer", "stage"}))
        self.assertEqual(self.fams["exl3_worker_errors_total"], ("counter", {"code"}))

    def test_good_expressions_pass(self):
        self.assertEqual(self.problems('sum by (layer, le) (rate(exl3_worker_layer_latency_seconds_bucket{stage="q"}[1m]))'), [])
        self.assertEqual(self.problems('sum by (code, instance) (rate(exl3_worker_errors_total[1m])) or exl3_worker_queue_depth'), [])

    def test_unknown_metric(self):
        self.assertIn("not found", self.problems("rate(exl3_worker_nope_total[1m])")[0])

    def test_bare_histogram(self):
        self.assertIn("without _bucket", self.problems("exl3_worker_layer_latency_seconds")[0])

    def test_unknown_label(self):
        self.assertIn("no label expert", self.problems('exl3_worker_errors_total{expert="3"}')[0])

    def test_unknown_grouping_label(self):
        self.assertIn("grouping by layer", self.problems("sum by (layer) (exl3_worker_errors_total)")[0])

    def test_undefined_recording_rule(self):
        self.assertIn("not a recording rule", self.problems("a:b:c")[0])
        self.assertEqual(self.problems("a:b:c", recorded={"a:b:c"}), [])

    def test_doc_table(self):
        doc = check_metric_names.families_from_doc(os.path.join(REPO, "docs", "metrics.md"))
        self.assertEqual(doc["exl3_router_layer_latency_seconds"], ("histogram", {"layer", "stage"}))
        self.assertEqual(doc["exl3_worker_info"], ("gauge", {"backend", "device", "version"}))


class CheckersOnBrokenCopiesTest(unittest.TestCase):
    def test_k8s(self):
        with BrokenCopy() as c:
            rc, out = run_checker("check_k8s.py", "--kubectl", TOOLS["kubectl"], os.path.join(c.deploy, "k8s"))
            self.assertEqual(rc, 0, out)
            c.edit("deploy/k8s/overlays/datacenter/worker-patch.yaml", "replicas: 10", "replicas: 9")
            c.edit("deploy/k8s/base/worker.yaml", "readinessProbe:", "readinesProbe:")
            c.edit("deploy/k8s/base/monitoring.yaml", "interval: 5s", "interval: 5sec")
            # The dgx-spark overlay's own map (the two-Spark memory plan) is checked, not the base's.
            c.edit("deploy/k8s/overlays/dgx-spark/expert-map.yaml", "experts: 144-287", "experts: 150-287")
            rc, out = run_checker("check_k8s.py", "--kubectl", TOOLS["kubectl"], os.path.join(c.deploy, "k8s"))
            self.assertEqual(rc, 1)
            self.assertIn("are not the StatefulSet's pods", out)
            self.assertIn("overlays/dgx-spark: expert map leaves experts [144, 145", out)
            self.assertIn("'readinesProbe' was unexpected", out)
            self.assertIn("'5sec' does not match", out)

    def test_compose(self):
        with BrokenCopy() as c:
            args = ["--check-jsonschema", TOOLS["check-jsonschema"], c.deploy]
            rc, out = run_checker("check_compose.py", *args)
            self.assertEqual(rc, 0, out)
            c.edit("deploy/compose/docker-compose.yml", "--worker=worker-1", "--worker=worker-2")
            c.edit("deploy/compose/docker-compose.yml", "    restart: unless-stopped", "    restrt: unless-stopped")
            c.edit("deploy/prometheus/prometheus.yml", '"127.0.0.1:9462"', '"127.0.0.1:9999"')
            c.edit("deploy/compose/docker-compose.yml", "--listen=127.0.0.1:8000", "--listen=0.0.0.0:8000")
            c.edit("deploy/compose/docker-compose.cpu.yml", "service_completed_successfully", "service_started")
            rc, out = run_checker("check_compose.py", *args)
            self.assertEqual(rc, 1)
            self.assertIn("'restrt' was unexpected", out)
            self.assertIn("must run with --worker=worker-1", out)
            self.assertIn("the services expose", out)
            self.assertIn("must wait for model-init", out)
            self.assertIn("frontend: --listen=0.0.0.0:8000 must bind 127.0.0.1", out)

    def test_runbooks(self):
        with BrokenCopy() as c:
            doc = os.path.join(c.tmp, "docs", "operations.md")
            self.assertEqual(run_checker("check_runbooks.py", c.deploy, doc)[0], 0)
            c.edit("docs/operations.md", "### Exl3Failovers", "### Failovers")
            rc, out = run_checker("check_runbooks.py", c.deploy, doc)
            self.assertEqual(rc, 1)
            self.assertIn("Exl3Failovers: docs/operations.md has no section", out)

    def test_dashboards_and_names(self):
        with BrokenCopy() as c:
            self.assertEqual(run_checker("check_dashboards.py", c.deploy)[0], 0)
            c.edit("deploy/grafana/dashboards/exl3-workers.json",
                   'exl3_worker_pinned_bytes{instance=~\\"$worker_instance\\"}', "exl3_worker_pinned_byte")
            rc, out = run_checker("check_dashboards.py", c.deploy)
            self.assertEqual(rc, 1)
            self.assertIn("not filtered by $worker_instance", out)
            rc, out = run_checker("check_metric_names.py", "--deploy", c.deploy,
                                  "--doc", os.path.join(REPO, "docs", "metrics.md"))
            self.assertEqual(rc, 1)
            self.assertIn("metric exl3_worker_pinned_byte not found", out)
        with BrokenCopy() as c:
            c.edit("deploy/grafana/dashboards/exl3-overview.json",
                   'exl3_frontend_engine_up{instance=~\\"$frontend_instance\\"}', "exl3_frontend_engine_up")
            rc, out = run_checker("check_dashboards.py", c.deploy)
            self.assertEqual(rc, 1)
            self.assertIn("exl3_frontend_engine_up not filtered by $frontend_instance", out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubectl", required=True)
    ap.add_argument("--check-jsonschema", required=True)
    args, rest = ap.parse_known_args()
    TOOLS["kubectl"] = os.path.abspath(args.kubectl)
    TOOLS["check-jsonschema"] = os.path.abspath(args.check_jsonschema)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=1)


if __name__ == "__main__":
    main()
