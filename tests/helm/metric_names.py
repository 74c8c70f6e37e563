"""The metrics every worker serves at /metrics (design.md, "Operating it"), by type.

Alerts, the dashboard and docs/operations.md may use these names and no others: a
renamed metric must fail here, not leave a dashboard panel empty in production.
"""

from __future__ import annotations

METRICS: dict[str, str] = {
    "stepstream_commands_applied_total": "counter",
    "stepstream_workflows_total": "counter",
    "stepstream_steps_total": "counter",
    "stepstream_step_attempt_duration_seconds": "histogram",
    "stepstream_workflow_duration_seconds": "histogram",
    "stepstream_queue_waiting": "gauge",
    "stepstream_queue_running": "gauge",
    "stepstream_queue_admission_wait_seconds": "histogram",
    "stepstream_timers_pending": "gauge",
    "stepstream_timers_held": "gauge",
    "stepstream_timer_lateness_seconds": "histogram",
    "stepstream_timers_fired_total": "counter",
    "stepstream_commit_batch_records": "histogram",
    "stepstream_commit_duration_seconds": "histogram",
    "stepstream_replay_duration_seconds": "histogram",
    "stepstream_restore_duration_seconds": "gauge",
    "stepstream_rocksdb_memory_bytes": "gauge",
    "stepstream_rocksdb_memory_limit_bytes": "gauge",
    "stepstream_instance_cache_size": "gauge",
    "stepstream_instance_cache_hits_total": "counter",
    "stepstream_instance_cache_misses_total": "counter",
    "stepstream_dead_letters_total": "counter",
    "stepstream_instances_set_apart_total": "counter",
    "stepstream_parked_instances": "gauge",
    "stepstream_consumer_lag_records": "gauge",
    "stepstream_source_lag_records": "gauge",
    "stepstream_rebalances_total": "counter",
    "stepstream_partitions_owned": "gauge",
    "stepstream_ready": "gauge",
    "stepstream_kafka_login_refused": "gauge",
    "stepstream_kafka_login_refusals_total": "counter",
    "stepstream_gc_pause_seconds": "histogram",
    "stepstream_gc_pause_max_seconds": "gauge",
    "stepstream_spans_dropped_total": "counter",
    "stepstream_build_info": "gauge",
    "stepstream_workflow_schedule_to_start_seconds": "histogram",
    "stepstream_step_schedule_to_start_seconds": "histogram",
    "stepstream_partition_owned": "gauge",
    "stepstream_http_requests_total": "counter",
    "stepstream_http_request_duration_seconds": "histogram",
    "stepstream_api_pending_calls": "gauge",
    "stepstream_api_pending_waits": "gauge",
    "stepstream_api_max_pending_calls": "gauge",
    "stepstream_api_refused_calls_total": "counter",
    "stepstream_api_sessions": "gauge",
    "stepstream_api_session_calls_total": "counter",
    "stepstream_api_session_frames_total": "counter",
    # prometheus_client's process and platform collectors (Linux).
    "process_cpu_seconds_total": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "python_info": "gauge",
    "python_gc_objects_collected_total": "counter",
    "python_gc_objects_uncollectable_total": "counter",
    "python_gc_collections_total": "counter",
    "stepstream_schedule_slots_skipped_total": "counter",
    "stepstream_schedule_instances_started_total": "counter",
}

# Served besides by `stepstream dev --processes N` (every other series gets a `process`
# label there).
PROCESSES_METRICS: dict[str, str] = {
    "stepstream_engine_process_restarts_total": "counter",
    "stepstream_engine_process_hangs_total": "counter",
}

# Prometheus adds this series for every scrape target itself.
SCRAPE_SERIES = frozenset({"up"})


def series_names() -> frozenset[str]:
    """The series a query may select: a histogram is its _bucket, _sum and _count."""
    names = set(SCRAPE_SERIES)
    for name, kind in METRICS.items():
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return frozenset(names)
