"""JSON schemas for the Prometheus operator objects that deploy/k8s uses (monitoring.coreos.com/v1).

kubernetes-validate has schemas for the built-in kinds only. These are written here from the
operator's v1 API reference, restricted to the fields an exl3serve deployment may set, and strict
(unknown fields are errors, as with `kubectl apply --validate=strict` against the real CRDs).
"""

DURATION = {"type": "string",
            "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": STR_MAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["key", "operator"],
            "properties": {"key": {"type": "string"},
                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
NAMESPACE_SELECTOR = {"type": "object", "additionalProperties": False,
                      "properties": {"any": {"type": "boolean"},
                                     "matchNames": {"type": "array", "items": {"type": "string"}}}}
RELABEL = {"type": "array", "items": {
    "type": "object", "additionalProperties": False,
    "properties": {"action": {"type": "string"}, "modulus": {"type": "integer"},
                   "regex": {"type": "string"}, "replacement": {"type": "string"},
                   "separator": {"type": "string"},
                   "sourceLabels": {"type": "array", "items": {"type": "string"}},
                   "targetLabel": {"type": "string"}}}}
SECRET_KEY = {"type": "object", "additionalProperties": False, "required": ["key"],
              "properties": {"key": {"type": "string"}, "name": {"type": "string"},
                             "optional": {"type": "boolean"}}}
TLS_CONFIG = {"type": "object", "additionalProperties": False,
              "properties": {"ca": {"type": "object"}, "cert": {"type": "object"},
                             "keySecret": SECRET_KEY, "serverName": {"type": "string"},
                             "insecureSkipVerify": {"type": "boolean"},
                             "caFile": {"type": "string"}, "certFile": {"type": "string"},
                             "keyFile": {"type": "string"}}}
ENDPOINT_COMMON = {
    "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
    "params": {"type": "object"}, "interval": DURATION, "scrapeTimeout": DURATION,
    "tlsConfig": TLS_CONFIG, "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"}, "metricRelabelings": RELABEL, "relabelings": RELABEL,
    "followRedirects": {"type": "boolean"}, "enableHttp2": {"type": "boolean"},
    "filterRunning": {"type": "boolean"},
    "targetPort": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
}
METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1},
                           "namespace": {"type": "string"}, "labels": STR_MAP,
                           "annotations": STR_MAP}}


def _kind(kind, spec):
    return {"type": "object", "additionalProperties": False,
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"},
                           "kind": {"const": kind}, "metadata": METADATA, "spec": spec}}


SERVICE_MONITOR = _kind("ServiceMonitor", {
    "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
    "properties": {
        "jobLabel": {"type": "string"},
        "targetLabels": {"type": "array", "items": {"type": "string"}},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "selector": LABEL_SELECTOR, "namespaceSelector": NAMESPACE_SELECTOR,
        "sampleLimit": {"type": "integer"},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False,
            "properties": dict(ENDPOINT_COMMON, port={"type": "string"})}},
    }})

POD_MONITOR = _kind("PodMonitor", {
    "type": "object", "additionalProperties": False,
    "required": ["selector", "podMetricsEndpoints"],
    "properties": {
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "selector": LABEL_SELECTOR, "namespaceSelector": NAMESPACE_SELECTOR,
        "sampleLimit": {"type": "integer"},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False,
            "properties": dict(ENDPOINT_COMMON, port={"type": "string"},
                               portNumber={"type": "integer"})}},
    }})

RULE = {"type": "object", "additionalProperties": False, "required": ["expr"],
        "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
        "properties": {"record": {"type": "string"}, "alert": {"type": "string"},
                       "expr": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                       "for": DURATION, "keep_firing_for": DURATION,
                       "labels": STR_MAP, "annotations": STR_MAP}}

PROMETHEUS_RULE = _kind("PrometheusRule", {
    "type": "object", "additionalProperties": False, "required": ["groups"],
    "properties": {"groups": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "rules"],
        "properties": {"name": {"type": "string", "minLength": 1}, "interval": DURATION,
                       "query_offset": DURATION, "limit": {"type": "integer"},
                       "partial_response_strategy": {"type": "string"},
                       "labels": STR_MAP, "rules": {"type": "array", "items": RULE}}}}}})

SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PodMonitor": POD_MONITOR,
           "PrometheusRule": PROMETHEUS_RULE}
