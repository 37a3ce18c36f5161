"""What operators see: the health counters, tracing, outage logs, and what may
be shown to a person (redaction)."""
