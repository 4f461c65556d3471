"""What operators see: metrics, readiness and liveness, logs, the audit trail."""
