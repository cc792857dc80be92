"""Event schemas, the Kafka event log, the sessions-feedback join and the embedded broker."""
