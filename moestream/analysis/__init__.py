"""Workload analysis: access traces, replay, profiles, statistics, disk probe, forecast, synthetic models."""
