"""Dashboards and alert rules users load into Grafana and Prometheus."""
