#!/usr/bin/env python3
"""Writes packaging/kubernetes/vmdisk-monitoring.yaml from vmdisk-alerts.yaml and
vmdisk-dashboard.json (the one source of each): the alerts as a PrometheusRule (kube-prometheus,
prometheus-operator) and the dashboard as a ConfigMap that kube-prometheus-stack's Grafana
sidecar loads (label grafana_dashboard: "1"). integration/cases/packages.rs checks the committed file
is what this writes. Usage: kubernetes.py > packaging/kubernetes/vmdisk-monitoring.yaml"""
import json
import os
import sys

import yaml

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "vmdisk-alerts.yaml")) as f:
    rules = yaml.safe_load(f)
with open(os.path.join(here, "vmdisk-dashboard.json")) as f:
    dashboard = json.load(f)

header = """# vmdisk's alerts and dashboard for kube-prometheus users: a PrometheusRule and a ConfigMap the
# Grafana sidecar of kube-prometheus-stack loads (label grafana_dashboard: "1"). Written by
# packaging/monitoring/kubernetes.py from packaging/monitoring/vmdisk-alerts.yaml and
# vmdisk-dashboard.json; docs/install.md#monitoring says how the node's metrics reach Prometheus.
"""
rule = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "PrometheusRule",
    "metadata": {
        "name": "vmdisk",
        "namespace": "vmdisk-system",
        "labels": {"app.kubernetes.io/name": "vmdisk", "role": "alert-rules"},
    },
    "spec": rules,
}
configmap = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {
        "name": "vmdisk-dashboard",
        "namespace": "vmdisk-system",
        "labels": {"app.kubernetes.io/name": "vmdisk", "grafana_dashboard": "1"},
    },
    "data": {"vmdisk.json": json.dumps(dashboard, indent=2) + "\n"},
}


class Literal(str):
    pass


def literal(dumper, value):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")


yaml.add_representer(Literal, literal)
for group in rule["spec"]["groups"]:
    for r in group["rules"]:
        if "\n" in r["expr"]:
            r["expr"] = Literal(r["expr"])
configmap["data"]["vmdisk.json"] = Literal(configmap["data"]["vmdisk.json"])
sys.stdout.write(header)
sys.stdout.write(yaml.dump_all([rule, configmap], sort_keys=False, width=100, explicit_start=True))
