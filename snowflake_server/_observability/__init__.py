"""What operators see: metrics, the admin endpoint (/metrics, /health), the audit trail."""
