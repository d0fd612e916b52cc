#!/usr/bin/env python3
"""Writes the Grafana dashboards in deploy/grafana/dashboards/ from the panel lists below.

The JSON files are committed; edit this file and run it again rather than editing the JSON:
  python3 deploy/grafana/generate_dashboards.py          # rewrite the JSON files
  python3 deploy/grafana/generate_dashboards.py --check  # exit 1 if they differ (used by CI)

Every dashboard is templated on the Prometheus datasource (`datasource`) and on the router, worker
and front-end instances (`router_instance`, `worker_instance`, `frontend_instance`, label
`instance`); the layer dashboards also on `layer`. Queries use only the metric names of docs/metrics.md (histograms through
_bucket/_sum/_count); scripts/checks/deploy.sh checks that against running binaries.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "dashboards")
DS = {"type": "prometheus", "uid": "${datasource}"}

R = 'instance=~"$router_instance"'
W = 'instance=~"$worker_instance"'
F = 'instance=~"$frontend_instance"'
RL = R + ', layer=~"$layer"'
RT = R + ', stage="total"'
WL = W + ', layer=~"$layer"'
RATE = "$__rate_interval"


def target(expr, legend="", ref="A", fmt=None, instant=False):
    t = {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend or "__auto",
         "range": not instant, "instant": instant}
    if fmt:
        t["format"] = fmt
    return t


def targets(*pairs):
    """pairs of (expr, legend) -> targets with refIds A, B, C..."""
    return [target(e, l, ref=chr(ord("A") + i)) for i, (e, l) in enumerate(pairs)]


def timeseries(title, tgts, unit="short", desc="", stack=False, min0=True):
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
              "showPoints": "never", "spanNulls": False,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    defaults = {"unit": unit, "custom": custom}
    if min0:
        defaults["min"] = 0
    return {"type": "timeseries", "title": title, "description": desc, "datasource": DS,
            "targets": tgts, "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "right",
                                   "calcs": ["lastNotNull", "max"], "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title, expr, unit="short", desc="", thresholds=None, legend=""):
    steps = thresholds or [{"color": "green", "value": None}]
    return {"type": "stat", "title": title, "description": desc, "datasource": DS,
            "targets": [target(expr, legend)],
            "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute",
                                                                      "steps": steps}},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "area", "textMode": "auto",
                        "justifyMode": "auto", "orientation": "auto"}}


def bargauge(title, expr, legend, unit="short", desc="", instant=True):
    return {"type": "bargauge", "title": title, "description": desc, "datasource": DS,
            "targets": [target(expr, legend, instant=instant, fmt="time_series")],
            "fieldConfig": {"defaults": {"unit": unit, "min": 0,
                                         "thresholds": {"mode": "absolute", "steps": [
                                             {"color": "green", "value": None}]}},
                            "overrides": []},
            "options": {"displayMode": "gradient", "orientation": "horizontal",
                        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "showUnfilled": True, "valueMode": "color"}}


def heatmap(title, expr, desc=""):
    return {"type": "heatmap", "title": title, "description": desc, "datasource": DS,
            "targets": [target(expr, "{{le}}", fmt="heatmap")],
            "fieldConfig": {"defaults": {"custom": {"scaleDistribution": {"type": "linear"}}},
                            "overrides": []},
            "options": {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left",
                                                                    "unit": "s"},
                        "color": {"mode": "scheme", "scheme": "Spectral", "steps": 64,
                                  "exponent": 0.5, "fill": "dark-orange", "reverse": False},
                        "rowsFrame": {"layout": "auto"}, "tooltip": {"show": True,
                                                                     "yHistogram": True},
                        "legend": {"show": True}, "exemplars": {"color": "rgba(255,0,255,0.7)"}}}


def table(title, expr, desc=""):
    return {"type": "table", "title": title, "description": desc, "datasource": DS,
            "targets": [target(expr, "", instant=True, fmt="table")],
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"showHeader": True},
            "transformations": [{"id": "organize", "options": {
                "excludeByName": {"Time": True, "Value": True, "__name__": True}}}]}


def row(title):
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def count_quantile(q, metric, sel):
    """A quantile of a histogram of counts (requests, tokens, workers per event: integers). Prometheus
    interpolates linearly inside a bucket: with buckets 1, 2, 4, ... a histogram whose every
    observation is 1 (all in (0, 1]) has its median at 0.5, a batch size no batch has; rounded up,
    the value is a count within the same bucket."""
    return f"ceil(histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}[{RATE}]))))"


def quantile(q, metric, sel, by):
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{sel}}}[{RATE}])))")


def layout(items):
    """items: rows (full width) and (panel, width, height) tuples, laid out left to right."""
    panels, x, y, row_h, pid = [], 0, 0, 0, 1
    for it in items:
        if isinstance(it, dict):  # a row
            if x:
                y, x = y + row_h, 0
            it = dict(it, id=pid, gridPos={"h": 1, "w": 24, "x": 0, "y": y})
            panels.append(it)
            pid, y, row_h = pid + 1, y + 1, 0
            continue
        p, w, h = it
        if x + w > 24:
            y, x, row_h = y + row_h, 0, 0
        panels.append(dict(p, id=pid, gridPos={"h": h, "w": w, "x": x, "y": y}))
        pid, x, row_h = pid + 1, x + w, max(row_h, h)
    return panels


def variable(name, label, query, multi=True):
    return {"type": "query", "name": name, "label": label, "datasource": DS,
            "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "definition": query, "refresh": 2, "sort": 3, "multi": multi, "includeAll": True,
            "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [], "regex": "", "hide": 0}


def templating(with_layer):
    v = [{"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
          "current": {}, "hide": 0, "options": [], "refresh": 1, "regex": ""},
         variable("router_instance", "Router instance", "label_values(exl3_router_ready, instance)"),
         variable("worker_instance", "Worker instance", "label_values(exl3_worker_ready, instance)"),
         variable("frontend_instance", "Front-end instance",
                  "label_values(exl3_frontend_engine_up, instance)")]
    if with_layer:
        v.append(variable("layer", "MoE layer",
                          "label_values(exl3_router_layer_latency_seconds_count, layer)"))
    return {"list": v}


def dashboard(uid, title, desc, items, with_layer=False):
    return {
        "uid": uid, "title": title, "description": desc, "tags": ["exl3serve"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "timezone": "",
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "name": "Annotations & Alerts",
                                  "type": "dashboard"}]},
        "links": [{"title": "exl3serve", "type": "dashboards", "tags": ["exl3serve"],
                   "asDropdown": True, "includeVars": True, "keepTime": True}],
        "templating": templating(with_layer),
        "panels": layout(items),
    }


def engine_row():
    """The attention/router service's generation (exl3_engine_*, docs/metrics.md "Engine")."""
    def q(quant, metric):
        return f"histogram_quantile({quant}, sum by (le) (rate({metric}_bucket{{{R}}}[{RATE}])))"
    return [
        row("Engine (generation)"),
        (stat("Output tokens per second", f"sum(rate(exl3_engine_generation_tokens_total{{{R}}}[{RATE}]))",
              desc="Tokens generated per second by the engine (finished requests)."), 4, 4),
        (stat("Time to first token p50", q(0.5, "exl3_engine_time_to_first_token_seconds"), unit="s",
              desc="Median time from a request's acceptance to its first token."), 4, 4),
        (stat("Inter-token latency p50", q(0.5, "exl3_engine_inter_token_latency_seconds"), unit="s",
              desc="Median of the requests' mean time between tokens."), 4, 4),
        (stat("Sequences running", f"sum(exl3_engine_num_requests_running{{{R}}})",
              desc="Sequences running in the engine (waiting ones: the panel below)."), 4, 4),
        (stat("KV cache usage", f"max(exl3_engine_kv_cache_usage_ratio{{{R}}})", unit="percentunit",
              desc="Fraction of KV cache blocks in use (near 1: preemptions follow)."), 4, 4),
        (stat("Prefix cache hit rate",
              f"sum(rate(exl3_engine_prefix_cache_hits_total{{{R}}}[{RATE}])) / "
              f"clamp_min(sum(rate(exl3_engine_prefix_cache_queries_total{{{R}}}[{RATE}])), 1e-9)",
              unit="percentunit", desc="Prompt tokens found in the prefix cache over those looked up."), 4, 4),
        (timeseries("Request latency", targets(
            (q(0.5, "exl3_engine_time_to_first_token_seconds"), "TTFT p50"),
            (q(0.99, "exl3_engine_time_to_first_token_seconds"), "TTFT p99"),
            (q(0.5, "exl3_engine_inter_token_latency_seconds"), "ITL p50"),
            (q(0.5, "exl3_engine_e2e_request_latency_seconds"), "end to end p50"),
            (q(0.5, "exl3_engine_request_queue_time_seconds"), "queue p50")),
            unit="s", desc="Time to first token, inter-token latency, end-to-end and queue time."), 12, 8),
        (timeseries("Engine step by phase (mean)", targets(
            (f"sum by (phase) (rate(exl3_engine_step_phase_seconds_sum{{{R}, phase!=\"forward\"}}[{RATE}])) "
             f"/ sum by (phase) (rate(exl3_engine_step_phase_seconds_count{{{R}, phase!=\"forward\"}}[{RATE}]))",
             "{{phase}}"),
            (f"sum by (stage) (rate(exl3_engine_moe_stage_seconds_sum{{{R}}}[{RATE}])) "
             f"/ sum by (stage) (rate(exl3_engine_moe_stage_seconds_count{{{R}}}[{RATE}]))",
             "moe: {{stage}}")),
            unit="s", desc="Mean time of one engine step in each phase: the model's parts and the engine's own work around them; "
                           "the MoE phase's stages: with the experts in process gate and experts, with the experts on "
                           "workers wait (blocked on their answers) and, on the GPU engine, to_host / to_device (the "
                           "staging copies)."), 12, 8),
        (timeseries("Requests finished by reason", targets(
            (f"sum by (finish_reason) (rate(exl3_engine_requests_finished_total{{{R}}}[{RATE}]))",
             "{{finish_reason}}"),
            (f"sum(rate(exl3_engine_failed_steps_total{{{R}}}[{RATE}]))", "failed steps")),
            desc="Finished requests per second by reason (stop, length, abort, error), and failed steps."), 12, 8),
        (timeseries("Tokens, sequences and preemptions", targets(
            (f"sum(rate(exl3_engine_prompt_tokens_total{{{R}}}[{RATE}]))", "prompt tokens/s"),
            (f"sum(rate(exl3_engine_prompt_tokens_cached_total{{{R}}}[{RATE}]))", "cached prompt tokens/s"),
            (f"sum(rate(exl3_engine_generation_tokens_total{{{R}}}[{RATE}]))", "generated tokens/s"),
            (f"sum(exl3_engine_num_requests_waiting{{{R}}})", "waiting"),
            (f"sum(rate(exl3_engine_num_preemptions_total{{{R}}}[{RATE}]))", "preemptions/s")),
            desc="Prompt, cached and generated tokens per second; waiting sequences; preemptions per second."), 12, 8),
        (timeseries("Speculative decoding", targets(
            (f"sum(rate(exl3_engine_spec_decode_num_draft_tokens_total{{{R}}}[{RATE}]))", "draft tokens/s"),
            (f"sum(rate(exl3_engine_spec_decode_num_accepted_tokens_total{{{R}}}[{RATE}]))", "accepted tokens/s"),
            (f"sum(rate(exl3_engine_spec_decode_num_accepted_tokens_total{{{R}}}[{RATE}])) / "
             f"clamp_min(sum(rate(exl3_engine_spec_decode_num_draft_tokens_total{{{R}}}[{RATE}])), 1e-9)",
             "acceptance rate")),
            desc="With --speculative-method: draft tokens verified and accepted per second, and the "
                 "fraction accepted (zero when speculative decoding is off)."), 12, 8),
        (timeseries("Speculative verify step", targets(
            (q(0.5, "exl3_engine_spec_decode_verify_step_seconds"), "verify step p50"),
            (q(0.99, "exl3_engine_spec_decode_verify_step_seconds"), "verify step p99"),
            (f"sum(rate(exl3_engine_spec_decode_verify_step_seconds_sum{{{R}}}[{RATE}])) / "
             f"clamp_min(sum(rate(exl3_engine_spec_decode_verify_step_seconds_count{{{R}}}[{RATE}])), 1e-9)",
             "verify step mean")),
            unit="s", desc="The forward pass and sampling of the steps that verified drafts (compare with the "
                           "step phases above: what a verify chunk's extra positions cost)."), 12, 8),
        (timeseries("Speculative draft length", targets(
            (f"avg(exl3_engine_spec_decode_mean_draft_length{{{R}}})", "mean draft limit"),
            (f"sum(rate(exl3_engine_spec_decode_num_draft_tokens_total{{{R}}}[{RATE}])) / "
             f"clamp_min(sum(rate(exl3_engine_spec_decode_num_drafts_total{{{R}}}[{RATE}])), 1e-9)",
             "draft tokens per verify chunk")),
            desc="The running sequences' mean draft limit (with --speculative-draft-length adaptive each "
                 "sequence's own K; with goodput the drafts each step's choice gave it; else their cap), and "
                 "the draft tokens a verify chunk actually carried."), 12, 8),
    ]


def frontend_row():
    """The OpenAI-compatible front end: latency and answers as its clients see them
    (exl3_frontend_*, docs/metrics.md "Front end")."""
    def q(quant, metric):
        return f"histogram_quantile({quant}, sum by (le) (rate({metric}_bucket{{{F}}}[{RATE}])))"
    ok = [{"color": "green", "value": None}, {"color": "red", "value": 0.01}]
    return [
        row("Front end (as clients see it)"),
        (stat("HTTP requests per second", f"sum(rate(exl3_frontend_requests_total{{{F}}}[{RATE}]))",
              unit="reqps", desc="Generation requests answered per second (every status)."), 4, 4),
        (stat("Time to first token p50 (client)", q(0.5, "exl3_frontend_time_to_first_token_seconds"),
              unit="s", desc="Median time from the HTTP request's arrival to its first token's text sent."), 4, 4),
        (stat("Inter-token latency p50 (client)", q(0.5, "exl3_frontend_inter_token_latency_seconds"),
              unit="s", desc="Median gap between tokens as sent to the clients."), 4, 4),
        (stat("Requests open", f"sum(exl3_frontend_requests_running{{{F}}})",
              desc="Generation requests open in the front end (all its worker processes)."), 4, 4),
        (stat("Server errors (5xx)",
              f"sum(rate(exl3_frontend_requests_total{{{F}, status=~\"5..\"}}[{RATE}])) / "
              f"clamp_min(sum(rate(exl3_frontend_requests_total{{{F}}}[{RATE}])), 1e-9)",
              unit="percentunit", thresholds=ok,
              desc="Fraction of answers with a 5xx status (503: the engine away; 504: timeouts)."), 4, 4),
        (stat("Engine up (front-end view)", f"min(exl3_frontend_engine_up{{{F}}})",
              thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 1}],
              desc="1 while the engine answers the front end."), 4, 4),
        (timeseries("Latency as clients see it", targets(
            (q(0.5, "exl3_frontend_time_to_first_token_seconds"), "TTFT p50"),
            (q(0.99, "exl3_frontend_time_to_first_token_seconds"), "TTFT p99"),
            (q(0.5, "exl3_frontend_inter_token_latency_seconds"), "ITL p50"),
            (q(0.99, "exl3_frontend_inter_token_latency_seconds"), "ITL p99"),
            (q(0.5, "exl3_frontend_e2e_request_latency_seconds"), "end to end p50"),
            (q(0.99, "exl3_frontend_e2e_request_latency_seconds"), "end to end p99")),
            unit="s", desc="Measured by the front end: from the HTTP request's arrival to the first token's "
                           "text sent, between tokens sent, and to the answer's last byte (the engine's own view: "
                           "the Engine row)."), 12, 8),
        (timeseries("Answers by HTTP status", targets(
            (f"sum by (status) (rate(exl3_frontend_requests_total{{{F}}}[{RATE}]))", "{{status}}")),
            unit="reqps", stack=True,
            desc="Generation requests answered per second by HTTP status: 200; 400 bad requests; 429 engine "
                 "overloaded; 499 the client went away; 503 engine away; 504 timed out."), 12, 8),
    ]


def overview():
    red = [{"color": "green", "value": None}, {"color": "red", "value": 1}]
    ready = [{"color": "red", "value": None}, {"color": "green", "value": 1}]
    return dashboard("exl3-overview", "exl3serve / Overview",
                     "The front end as its clients see it; generation, throughput, decode step latency, health, errors and queues of the router and its workers.", [
        *frontend_row(),
        *engine_row(),
        row("Service"),
        (stat("Tokens per second",
              f"avg(sum by (layer) (rate(exl3_router_tokens_total{{{R}}}[{RATE}])))",
              desc="Decode tokens per second: every token visits each MoE layer once, so the average over layers of tokens routed per second."), 4, 4),
        (stat("Decode step (mean)",
              f"sum(sum by (layer) (rate(exl3_router_layer_latency_seconds_sum{{{R}, stage=\"total\"}}[{RATE}])) "
              f"/ sum by (layer) (rate(exl3_router_layer_latency_seconds_count{{{R}, stage=\"total\"}}[{RATE}])))",
              unit="s", desc="Sum over MoE layers of the mean router latency: the MoE part of one decode step."), 4, 4),
        (stat("Router ready", f"min(exl3_router_ready{{{R}}})", thresholds=ready,
              desc="1 while every expert has a serving worker."), 4, 4),
        (stat("Unserved experts", f"max(exl3_router_unserved_experts{{{R}}})", thresholds=red,
              desc="Routed experts (all layers) with no serving worker."), 4, 4),
        (stat("Workers up (router view)", f"sum(exl3_router_worker_up{{{R}}})",
              desc="Workers whose health is SERVING as the router sees them."), 4, 4),
        (stat("Error ratio",
              f"sum(rate(exl3_router_errors_total{{{R}}}[{RATE}])) / clamp_min(sum(rate(exl3_router_errors_total{{{R}}}[{RATE}])) "
              f"+ sum(rate(exl3_router_requests_total{{{R}}}[{RATE}])), 1e-9)",
              unit="percentunit", thresholds=[{"color": "green", "value": None},
                                              {"color": "red", "value": 0.01}]), 4, 4),
        row("End to end per decode step"),
        (timeseries("MoE time per decode step", targets(
            (f"sum(sum by (layer) (rate(exl3_router_layer_latency_seconds_sum{{{R}, stage=\"total\"}}[{RATE}])) "
             f"/ sum by (layer) (rate(exl3_router_layer_latency_seconds_count{{{R}, stage=\"total\"}}[{RATE}])))", "mean"),
            (f"sum({quantile(0.5, 'exl3_router_layer_latency_seconds', RT, 'layer')})",
             "sum of per-layer p50"),
            (f"sum({quantile(0.99, 'exl3_router_layer_latency_seconds', RT, 'layer')})",
             "sum of per-layer p99")),
            unit="s", desc="Router time over all MoE layers of one decode step (what the attention engine waits on)."), 12, 8),
        (timeseries("Tokens per second by layer", targets(
            (f"sum by (layer) (rate(exl3_router_tokens_total{{{R}}}[{RATE}]))", "layer {{layer}}")),
            unit="short"), 12, 8),
        (timeseries("Router stages (mean over layers)", targets(
            (f"sum by (stage) (rate(exl3_router_layer_latency_seconds_sum{{{R}, stage!=\"total\"}}[{RATE}])) "
             f"/ sum by (stage) (rate(exl3_router_layer_latency_seconds_count{{{R}, stage!=\"total\"}}[{RATE}]))", "{{stage}}")),
            unit="s", stack=True, desc="Where a layer request's time goes: gate, dispatch, waiting on workers, combine."), 12, 8),
        (timeseries("Layer requests per second", targets(
            (f"sum by (instance) (rate(exl3_router_requests_total{{{R}}}[{RATE}]))", "router {{instance}}"),
            (f"sum by (instance) (rate(exl3_worker_requests_total{{{W}}}[{RATE}]))", "worker {{instance}}")),
            unit="reqps"), 12, 8),
        row("Fan-out and bytes"),
        (timeseries("Fan-out width", targets(
            (count_quantile(0.5, "exl3_router_fanout_width", R), "p50"),
            (count_quantile(0.99, "exl3_router_fanout_width", R), "p99"),
            (f"sum(rate(exl3_router_fanout_width_sum{{{R}}}[{RATE}])) / sum(rate(exl3_router_fanout_width_count{{{R}}}[{RATE}]))", "mean")),
            desc="Workers one layer request fans out to."), 12, 8),
        (timeseries("Bytes to and from workers", targets(
            (f"sum by (instance) (rate(exl3_router_sent_bytes_total{{{R}}}[{RATE}]))", "sent {{instance}}"),
            (f"sum by (instance) (rate(exl3_router_received_bytes_total{{{R}}}[{RATE}]))", "received {{instance}}")),
            unit="Bps"), 12, 8),
        row("Worker health and failovers"),
        (timeseries("Worker up (router view)", targets(
            (f"max by (worker) (exl3_router_worker_up{{{R}}})", "{{worker}}"),
            (f"max by (worker) (exl3_router_worker_shm{{{R}}})", "shared memory {{worker}}")),
            desc="up: 1 while the worker's gRPC health is SERVING. shared memory: 1 while the router's stream to it runs over same-host shared memory (0: gRPC)."), 8, 8),
        (timeseries("Worker ready and scrape up", targets(
            (f"exl3_worker_ready{{{W}}}", "ready {{instance}}"),
            (f"up{{job=\"exl3-worker\", {W}}}", "scraped {{instance}}")),
            desc="ready: 1 while serving, 0 while loading or draining."), 8, 8),
        (timeseries("Failovers per second", targets(
            (f"sum by (worker) (rate(exl3_router_failovers_total{{{R}}}[{RATE}]))", "{{worker}}")),
            unit="ops", desc="Sub-requests re-sent to a replica after this worker failed."), 8, 8),
        row("Errors and queues"),
        (timeseries("Router errors by code", targets(
            (f"sum by (code) (rate(exl3_router_errors_total{{{R}}}[{RATE}]))", "{{code}}")),
            unit="reqps", stack=True), 8, 8),
        (timeseries("Worker errors by code", targets(
            (f"sum by (code) (rate(exl3_worker_errors_total{{{W}}}[{RATE}]))", "{{code}}")),
            unit="reqps", stack=True), 8, 8),
        (timeseries("Queue depth and in flight", targets(
            (f"exl3_worker_queue_depth{{{W}}}", "queued {{instance}}"),
            (f"exl3_router_requests_in_flight{{{R}}}", "in flight {{instance}}")),
            desc="Worker requests waiting to be batched; router layer requests accepted and not yet answered."), 8, 8),
        (timeseries("Cancellations sent to workers", targets(
            (f"sum by (reason) (rate(exl3_router_worker_cancels_total{{{R}}}[{RATE}]))", "{{reason}}")),
            unit="ops", stack=True,
            desc="Worker sub-requests the router withdrew because their layer request ended early "
                 "(client cancel, deadline, stream closed, another part failed)."), 12, 8),
        (timeseries("Cancellations at the workers", targets(
            (f"sum by (reason, outcome) (rate(exl3_worker_cancels_total{{{W}}}[{RATE}]))",
             "{{reason}} {{outcome}}")),
            unit="ops", stack=True,
            desc="dropped: removed from the queue, never computed (the saving); completed: already "
                 "computing, answered normally; late: the request had already been answered."), 12, 8),
    ])


def layers():
    def by_layer(metric, sel, q):
        return quantile(q, metric, sel + ', stage="total"', "layer")
    return dashboard("exl3-layers", "exl3serve / Per-layer latency",
                     "Per-MoE-layer latency at the router and the workers, by stage.", [
        row("Router: whole MoE layer (stage total)"),
        (heatmap("Router layer latency distribution",
                 f"sum by (le) (increase(exl3_router_layer_latency_seconds_bucket{{{RL}, stage=\"total\"}}[{RATE}]))",
                 desc="Distribution of the router's per-layer latency over the selected layers."), 12, 9),
        (bargauge("p99 by layer (now)", by_layer("exl3_router_layer_latency_seconds", RL, 0.99),
                  "layer {{layer}}", unit="s"), 12, 9),
        (timeseries("p50 by layer", targets(
            (by_layer("exl3_router_layer_latency_seconds", RL, 0.5), "layer {{layer}}")), unit="s"), 12, 8),
        (timeseries("p99 by layer", targets(
            (by_layer("exl3_router_layer_latency_seconds", RL, 0.99), "layer {{layer}}")), unit="s"), 12, 8),
        row("Router: by stage"),
        (timeseries("p99 by stage", targets(
            (quantile(0.99, "exl3_router_layer_latency_seconds", RL, "stage"), "{{stage}}")), unit="s"), 12, 8),
        (timeseries("Worker round trip p99 (router view)", targets(
            (quantile(0.99, "exl3_router_worker_rpc_latency_seconds", R, "worker"), "{{worker}}")), unit="s",
            desc="Round trip of one sub-request to each worker."), 12, 8),
        row("Workers"),
        (heatmap("Worker layer latency distribution",
                 f"sum by (le) (increase(exl3_worker_layer_latency_seconds_bucket{{{WL}, stage=\"total\"}}[{RATE}]))"), 12, 9),
        (timeseries("Worker p99 by stage", targets(
            (quantile(0.99, "exl3_worker_layer_latency_seconds", WL, "stage"), "{{stage}}")), unit="s",
            desc="queue: waiting to be batched; compute: the batch's kernel; total: both and the rest."), 12, 9),
        (timeseries("Worker p50 by layer", targets(
            (by_layer("exl3_worker_layer_latency_seconds", WL, 0.5), "layer {{layer}}")), unit="s"), 12, 8),
        (timeseries("Worker p99 by layer", targets(
            (by_layer("exl3_worker_layer_latency_seconds", WL, 0.99), "layer {{layer}}")), unit="s"), 12, 8),
    ], with_layer=True)


def workers():
    return dashboard("exl3-workers", "exl3serve / Workers and experts",
                     "Expert load balance, batching, memory and identity of the expert workers.", [
        row("Expert load balance"),
        (bargauge("Hot experts (top 20, tokens/s)",
                  f"topk(20, sum by (expert) (rate(exl3_worker_expert_tokens_total{{{W}}}[5m])))",
                  "expert {{expert}}", unit="short", desc="Tokens routed to each expert, all layers; candidates for replicas."), 12, 10),
        (timeseries("Expert imbalance (max / mean tokens per expert)", targets(
            (f"max(sum by (expert) (rate(exl3_worker_expert_tokens_total{{{W}}}[{RATE}]))) "
             f"/ avg(sum by (expert) (rate(exl3_worker_expert_tokens_total{{{W}}}[{RATE}])))", "max / mean")),
            desc="1 is perfectly even; large values mean a few experts carry the load."), 12, 10),
        (timeseries("Tokens per second by worker", targets(
            (f"sum by (instance) (rate(exl3_worker_tokens_total{{{W}}}[{RATE}]))", "{{instance}}")), stack=True), 12, 8),
        (timeseries("Requests per second by worker", targets(
            (f"sum by (instance) (rate(exl3_worker_requests_total{{{W}}}[{RATE}]))", "{{instance}}")), unit="reqps"), 12, 8),
        row("Batching"),
        (timeseries("Batch size (tokens)", targets(
            (count_quantile(0.5, "exl3_worker_batch_tokens", W), "p50"),
            (count_quantile(0.99, "exl3_worker_batch_tokens", W), "p99"),
            (f"sum(rate(exl3_worker_batch_tokens_sum{{{W}}}[{RATE}])) / sum(rate(exl3_worker_batch_tokens_count{{{W}}}[{RATE}]))", "mean")),
            desc="Tokens per executed batch."), 12, 8),
        (timeseries("Batch size (requests)", targets(
            (count_quantile(0.5, "exl3_worker_batch_requests", W), "p50"),
            (count_quantile(0.99, "exl3_worker_batch_requests", W), "p99"),
            (f"sum(rate(exl3_worker_batch_requests_sum{{{W}}}[{RATE}])) / sum(rate(exl3_worker_batch_requests_count{{{W}}}[{RATE}]))", "mean")),
            desc="Requests merged into one executed batch (continuous batching). The quantiles are rounded up "
                 "to whole requests: Prometheus interpolates inside a bucket, and batches of one request each "
                 "read 0.5 at the median without it."), 12, 8),
        row("Memory and identity"),
        (timeseries("Pinned weight memory", targets(
            (f"exl3_worker_pinned_bytes{{{W}}}", "{{instance}}")), unit="bytes", stack=True,
            desc="Weight bytes resident: device memory, registered or locked host memory."), 8, 8),
        (bargauge("Load time", f"exl3_worker_load_seconds{{{W}}}", "{{instance}}", unit="s",
                  desc="Time each worker took to load its experts (size the startup probe from it)."), 8, 8),
        (table("Worker build and backend", f"exl3_worker_info{{{W}}}"), 8, 8),
    ])


DASHBOARDS = {"exl3-overview.json": overview, "exl3-layers.json": layers,
              "exl3-workers.json": workers}


def render():
    return {name: json.dumps(fn(), indent=2, sort_keys=True) + "\n" for name, fn in DASHBOARDS.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    args = ap.parse_args()
    stale = []
    for name, text in render().items():
        path = os.path.join(OUT_DIR, name)
        old = open(path).read() if os.path.exists(path) else None
        if old == text:
            continue
        if args.check:
            stale.append(name)
        else:
            os.makedirs(OUT_DIR, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {path}")
    if stale:
        print("generate_dashboards: out of date: " + ", ".join(stale) +
              " (run python3 deploy/grafana/generate_dashboards.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
